"""Random-weight checkpoints written by HF transformers itself (its classes, init
and save_pretrained), plus the torch model as a numerical reference. Needs the
``test`` extra (torch, transformers)."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from moejax.models.registry import family_for
from moejax.tiny.checkpoint import FP8_BLOCK, fp8_quantization_config, quantize_tensors, write_checkpoint
from moejax.tiny.tokenizer import write_tokenizer
from moejax.weights.fp8 import dequantize_block_fp8
from moejax.weights.safetensors_io import SafetensorsFile, list_checkpoint_files


def hf_classes(model_type: str):
    """The transformers (config, model) classes of a model_type, from its family's entry."""
    names = family_for(model_type).transformers_classes.get(model_type)
    if names is None:
        raise ValueError(f"model_type {model_type!r}: transformers has no class for it (its family "
                         f"{family_for(model_type).name!r} lists none); write it with the NumPy writer instead")
    try:
        import transformers  # the test extra: optional
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("writing checkpoints with transformers needs `pip install -e .[test]`") from e
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def make_hf_checkpoint(directory: str, hf_config: dict, seed: int = 0, fp8: bool = False,
                       max_shard_size: str | None = None):
    """Builds the HF model with random weights, saves it to ``directory``, returns the
    float32 torch model (with FP8 weights already dequantised, so it is the exact reference)."""
    import torch  # the test extra: optional
    cfg_cls, model_cls = hf_classes(hf_config["model_type"])
    kwargs = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        # HF initialises norms to 1 and the correction bias to 0; perturb them so they are tested.
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn_like(t))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn_like(t))
    model.save_pretrained(directory, max_shard_size=max_shard_size or "5GB")
    write_tokenizer(directory)
    if not fp8:
        return model
    # Re-read what save_pretrained wrote (HF's on-disk names, one matrix per expert),
    # quantise it, and rebuild the reference from the dequantised values.
    files = list_checkpoint_files(directory)
    state = {k: np.array(SafetensorsFile(f).get(k)) for k, f in files.items()}
    for f in set(files.values()) | {os.path.join(directory, "model.safetensors.index.json")}:
        if os.path.exists(f):
            os.remove(f)
    tensors = quantize_tensors(state, family_for(hf_config["model_type"]).is_fp8_quantized)
    out_cfg = dict(hf_config, quantization_config=fp8_quantization_config())
    write_checkpoint(directory, out_cfg, tensors)
    deq = {k: (dequantize_block_fp8(tensors[k], tensors[k + "_scale_inv"], FP8_BLOCK) if k + "_scale_inv" in tensors
               else v) for k, v in state.items()}
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, hf_config, deq)
        return model_cls.from_pretrained(tmp, dtype=torch.float32).eval()
