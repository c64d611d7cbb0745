"""Builds the optional XLA FFI extension (ffi/, docs/ffi.md) with CMake during ``pip install``;
everything else is declared in pyproject.toml.

The shared libraries land in moejax/parallel/ (next to the code that loads them), in the wheel or,
for an editable install, in the source tree. Where the build cannot run (no cmake, no C++
compiler, no jaxlib headers) the install still succeeds with a warning, and only
``moe_backend: ffi`` is unavailable, with an error naming what is missing.

Where a CUDA toolkit with cuBLAS 12.9+ is found, cuBLASLt's block-scaled FP8 GEMM (ffi/cuda/build.sh) is
built too; elsewhere a line says so and kernel selection keeps the Triton / Pallas FP8 kernels."""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# host: always; mori: only where CMake finds hipcc and MoRI (ffi/mori/mori.cmake); fp8_gemm: only where
# ffi/cuda/build.sh finds CUDA and cuBLAS 12.9+
LIBRARIES = ("moejax_ep_host", "moejax_ep_mori", "moejax_fp8_gemm")


def _ffi_include_dir() -> str:
    """jax.ffi.include_dir() without importing jax (only jaxlib is a build requirement)."""
    import jaxlib
    return str(Path(jaxlib.__file__).parent / "include")


def _cmake() -> str | None:
    try:
        import cmake  # the pip package, a build requirement
        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        return shutil.which("cmake")


class CMakeBuild(build_ext):
    """Configures and builds ffi/ once, then hands setuptools the libraries that were built."""

    def run(self):
        built = self._build_with_cmake()
        built.update(self._build_cublaslt())
        self.extensions = [e for e in self.extensions if e.name.rsplit(".", 1)[1] in built]
        self._built = built
        super().run()

    def _build_with_cmake(self) -> dict:
        cmake = _cmake()
        try:
            include = _ffi_include_dir()
        except ImportError:
            include = None
        missing = [what for what, ok in (("cmake", cmake), ("jaxlib (for the XLA FFI headers)", include)) if not ok]
        if missing:
            self._skip(f"{' and '.join(missing)} not found.")
            return {}
        out = Path(self.build_temp).resolve() / "moejax_ffi"
        cfg = [cmake, "-S", str(HERE / "ffi"), "-B", str(out / "build"), f"-DXLA_FFI_INCLUDE_DIR={include}",
               "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out / 'lib'}"]
        build = [cmake, "--build", str(out / "build"), "-j", str(os.cpu_count() or 1), "--target"]
        for step, cmd in (("configure", cfg), ("build", [*build, "moejax_ep_host"])):
            try:
                subprocess.run(cmd, check=True)
            except (subprocess.CalledProcessError, OSError) as e:
                why = f"exit {e.returncode}" if isinstance(e, subprocess.CalledProcessError) else str(e)
                self._skip(f"The CMake {step} step failed ({why}; its output is above): is a C++17 compiler installed?")
                return {}
        if "MOEJAX_FFI_MORI:INTERNAL=ON" in (out / "build" / "CMakeCache.txt").read_text():
            try:  # hipcc and MoRI were found (ffi/mori/mori.cmake); its failure leaves the host library
                subprocess.run([*build, "moejax_ep_mori"], check=True)
            except subprocess.CalledProcessError as e:
                warnings.warn(f"moejax: the MoRI implementation of the FFI extension failed to build ({e})")
        return {name: out / "lib" / f"lib{name}.so" for name in LIBRARIES if (out / "lib" / f"lib{name}.so").exists()}

    def _build_cublaslt(self) -> dict:
        """cuBLASLt's FP8 GEMM (a g++ build of one file, no CMake): built where CUDA is found, skipped with a
        line elsewhere (build.sh exits 3), a warning where it is found but the build fails."""
        out = Path(self.build_temp).resolve() / "moejax_cuda"
        env = dict(os.environ, PYTHON=sys.executable)
        try:
            env["XLA_FFI_INCLUDE_DIR"] = _ffi_include_dir()
        except ImportError:
            pass  # build.sh then asks jax
        try:
            subprocess.run(["bash", str(HERE / "ffi" / "cuda" / "build.sh"), str(out)], check=True, env=env)
        except (subprocess.CalledProcessError, OSError) as e:
            if getattr(e, "returncode", None) == 3:
                print("moejax: cuBLASLt's FP8 GEMM not built (no CUDA toolkit with cuBLAS 12.9+ found, see above); "
                      "FP8 GEMMs use the Triton / Pallas kernels", file=sys.stderr)
            else:
                warnings.warn(f"moejax: cuBLASLt's FP8 GEMM (ffi/cuda/build.sh) failed to build ({e}); FP8 GEMMs "
                              f"use the Triton / Pallas kernels")
            return {}
        return {"moejax_fp8_gemm": out / "libmoejax_fp8_gemm.so"}

    def _skip(self, why: str):  # why: a sentence
        msg = (f"moejax: the XLA FFI extension (moe_backend: ffi) is not built. {why} Everything else works; "
               f"docs/ffi.md says how to build it.")
        warnings.warn(msg)
        print(f"WARNING: {msg}", file=sys.stderr)

    def get_ext_filename(self, fullname):
        # a plain shared library loaded through ctypes, not a Python module: keep CMake's name
        *package, name = fullname.split(".")
        return os.path.join(*package, f"lib{name}.so")

    def build_extension(self, ext):
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._built[ext.name.rsplit(".", 1)[1]], dest)


setup(ext_modules=[Extension(f"moejax.parallel.{name}", sources=[]) for name in LIBRARIES],
      cmdclass={"build_ext": CMakeBuild})
