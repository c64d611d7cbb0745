"""moejax: a JAX/XLA inference engine for Mixture-of-Experts LLMs (DeepSeek-V2/V3/R1, Step3)."""

from moejax.xla_flags import set_xla_flags

set_xla_flags()  # before any JAX backend exists (moejax/xla_flags.py says which and why)

from moejax.config import CacheConfig, EngineConfig, SchedulerConfig
from moejax.engine.sampling_params import SamplingParams
from moejax.generate import GenerationResult, generate
from moejax.model import Model, load, save
from moejax.models.registry import load_model_config, parse_model_config

__all__ = ["CacheConfig", "EngineConfig", "SchedulerConfig", "SamplingParams", "GenerationResult", "Model",
           "generate", "load", "save", "load_model_config", "parse_model_config"]
__version__ = "0.1.0"
