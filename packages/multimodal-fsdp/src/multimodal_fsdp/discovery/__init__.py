"""Finding towers, projectors and media-dependent decoder layers in a module tree.

The walk ([`multimodal_fsdp.discovery.walk`][multimodal_fsdp.discovery.walk]) matches a
module by its attribute name ([`multimodal_fsdp.discovery.names`][multimodal_fsdp.discovery.names])
or its structure ([`multimodal_fsdp.discovery.structure`][multimodal_fsdp.discovery.structure]);
decoder layers that run only with media are found by
[`multimodal_fsdp.discovery.conditional`][multimodal_fsdp.discovery.conditional]. Nothing here
decides how anything is sharded.
"""

from multimodal_fsdp.discovery.walk import iter_multimodal_modules, resolve_multimodal_modules

__all__ = ["iter_multimodal_modules", "resolve_multimodal_modules"]
