"""moejax: a JAX/XLA inference engine for Mixture-of-Experts LLMs (DeepSeek-V2/V3)."""

from moejax.config import ModelConfig
from moejax.engine.sampling_params import SamplingParams
from moejax.generate import GenerationResult, generate
from moejax.model import Model, load, save

__all__ = ["ModelConfig", "SamplingParams", "GenerationResult", "Model", "generate", "load", "save"]
__version__ = "0.1.0"
