"""dsserve: a serving engine for the DeepSeek-V4.1-Flash model family."""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use, so that ``dsserve --help`` and the server's front do not load torch for nothing.
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from .engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'dsserve' has no attribute {name!r}")
