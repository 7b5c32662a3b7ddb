"""Single source of the model-deepseek-v41 version (read by hatch)."""

__version__ = "0.1.0"
