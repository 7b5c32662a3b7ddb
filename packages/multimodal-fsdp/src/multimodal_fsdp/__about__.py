"""Single source of the multimodal-fsdp version (read by hatch)."""

__version__ = "0.1.0"
