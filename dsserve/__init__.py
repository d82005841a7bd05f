"""dsserve: a serving engine for the DeepSeek-V4.1-Flash model family."""

from .engine.llm import LLM
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
