"""Finding towers, projectors and media-dependent decoder layers in a module tree (the
[`walk`][multimodal_fsdp.discovery.walk]; the layers:
[`conditional`][multimodal_fsdp.discovery.conditional]). Nothing here decides sharding.
"""

from multimodal_fsdp.discovery.walk import iter_multimodal_modules, resolve_multimodal_modules

__all__ = ["iter_multimodal_modules", "resolve_multimodal_modules"]
