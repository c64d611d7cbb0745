"""Whether a serialized XLA:CPU executable is whole: every function its thunks call (kernels, sort
comparators) is listed as a compiled symbol and defined in one of the object files it carries.

One that is not fails only once loaded in another process, at run time: "Function broadcast_add_fusion
not found (type id: 1)". The case met (issue 42's "Function broadcast.NN_kernel not found"): an executable
that JAX's persistent compilation cache handed back (XLA:CPU loads it from its serialized form and keeps
neither its object files nor its symbol list), serialized again for the executable cache.
moejax/compilation.py's ``exclusive_of_executable_cache`` avoids it; this check is what guarantees that
no such entry is kept or run, whatever else loses a part.

``cpu_problem`` reads the serialized form (jax's pickle, IFRT's length-prefixed header, then XLA's
CompilationResultProto: field 6 the thunk sequence, 7 the compiled symbols, 8 the object files) and the
object files' ELF symbol tables; a form it cannot read is a problem too (an entry that cannot be checked
is not kept).
"""

from __future__ import annotations

import pickletools
import struct

# xla/service/cpu/executable.proto, CompilationResultProto
_THUNKS, _COMPILED_SYMBOLS, _OBJ_FILES = 6, 7, 8
# SymbolProto: 1 function type id, 2 name; ObjFileProto: 1 contents, 2 name
_SYMBOL_NAME, _OBJ_CONTENTS = 2, 1
# xla/backends/cpu/runtime/thunk.proto, ThunkProto: 1 its kind; a kernel thunk's name in 11.1, a sort
# thunk's comparator in 5.4 (nested sequences, e.g. a while loop's body, hold ThunkProtos of their own)
_KIND, _KERNEL, _KERNEL_NAME, _SORT, _COMPARATOR = 1, 11, 1, 5, 4


class Unreadable(ValueError):
    """Not the layout this check knows (another jaxlib, another object format)."""


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        if i >= len(b):
            raise Unreadable("truncated varint")
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def _fields(b: bytes) -> list[tuple[int, object]]:
    """A protobuf message's (field number, value) pairs, in order; length-delimited values as bytes."""
    i, out = 0, []
    while i < len(b):
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise Unreadable("field number 0")
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        else:
            raise Unreadable(f"wire type {wire}")
        if i > len(b):
            raise Unreadable("truncated field")
        out.append((field, v))
    return out


def serialized_executables(pickled: bytes) -> list[bytes]:
    """The PjRt executables inside ``jax.experimental.serialize_executable.serialize``'s pickle: its
    persistent ids ('exec', bytes), read from the opcodes (nothing is unpickled)."""
    out, recent = [], []
    for op, arg, _ in pickletools.genops(pickled):
        if op.name == "BINPERSID":
            if len(recent) >= 2 and recent[-2] == "exec" and isinstance(recent[-1], bytes):
                out.append(recent[-1])
        elif isinstance(arg, (str, bytes)):
            recent = (recent + [arg])[-2:]
    return out


def _elf_defined_symbols(obj: bytes) -> set[str]:
    """Names an ELF64 little-endian object file defines (its symbol tables, undefined entries excluded)."""
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        raise Unreadable("an object file that is not little-endian ELF64")
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + k * shentsize) for k in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2 or not entsize:  # SHT_SYMTAB
            continue
        str_off = sections[link][4]
        for k in range(size // entsize):
            st_name, _, _, st_shndx = struct.unpack_from("<IBBH", obj, offset + k * entsize)
            if st_shndx == 0 or not st_name:  # SHN_UNDEF
                continue
            end = obj.index(b"\0", str_off + st_name)
            names.add(obj[str_off + st_name:end].decode())
    return names


def _called_functions(message: bytes, depth: int = 0) -> set[str]:
    """Names of the functions the thunks in ``message`` (and the messages nested in it) call."""
    try:
        fields = _fields(message)
    except Unreadable:
        return set()  # bytes, not a message
    out = set()
    kind = dict(fields).get(_KIND)
    for f, v in fields:
        if not isinstance(v, bytes) or not v:
            continue
        if (kind, f) in ((b"kernel", _KERNEL), (b"sort", _SORT)):
            name = dict(_fields(v)).get(_KERNEL_NAME if f == _KERNEL else _COMPARATOR)
            if isinstance(name, bytes) and name:
                out.add(name.decode())
        elif depth < 16:
            out |= _called_functions(v, depth + 1)
    return out


def missing_functions(executable: bytes) -> list[str]:
    """The functions one serialized XLA:CPU executable calls (its thunks' kernels and comparators, and its
    compiled symbols) that are not both listed as compiled symbols and defined in one of its object files."""
    header_len, i = _varint(executable, 0)  # IFRT's wrapper: a length-prefixed header, then PjRt's proto
    outer = _fields(executable[i + header_len:])
    results = [v for f, v in outer if f == 1 and isinstance(v, bytes)]
    if len(results) != 1:
        raise Unreadable("no compilation result in the executable")
    fields = _fields(results[0])
    symbols = [dict(_fields(v)).get(_SYMBOL_NAME) for f, v in fields if f == _COMPILED_SYMBOLS]
    objects = [dict(_fields(v)).get(_OBJ_CONTENTS) for f, v in fields if f == _OBJ_FILES]
    if not symbols or not objects or not all(isinstance(s, bytes) for s in symbols) \
            or not all(isinstance(o, bytes) for o in objects):
        raise Unreadable("no compiled symbols or object files where XLA:CPU keeps them")
    thunks = [v for f, v in fields if f == _THUNKS]
    if len(thunks) != 1:
        raise Unreadable("no thunk sequence where XLA:CPU keeps it")
    listed = {s.decode() for s in symbols}
    defined = set().union(*(_elf_defined_symbols(o) for o in objects))
    return sorted((listed | _called_functions(thunks[0])) - (listed & defined))


def cpu_problem(pickled: bytes) -> str | None:
    """Why a serialized CPU executable (serialize_executable's pickle) must not be kept, or None if it is
    complete."""
    try:
        executables = serialized_executables(pickled)
        if not executables:
            return "no executable in the serialized form"
        missing = sorted({m for e in executables for m in missing_functions(e)})
    except (Unreadable, struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        return f"its serialized form cannot be checked ({e})"
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return (f"{len(missing)} of its functions are in no object file ({shown}): XLA:CPU's parallel codegen "
                "lost a part (an upstream race); it would fail at run time once loaded")
    return None
