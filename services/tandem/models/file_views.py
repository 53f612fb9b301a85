"""Copy out the weights that still view a model's checkpoint file once it has loaded on a CPU.

from_pretrained maps a safetensors file into memory and keeps a tensor whose dtype the file already holds as a view
of that mapping (the embedding and the norms of the Qwen pair in bf16; the products are packed into copies of their
own, core.packed_linear). One such view keeps the whole mapping alive, and with it every page of the file the load
read: 3.2 GB of the 1.5B target's 6.4 GB resident memory, for a 0.44 GB embedding (docs/performance.md, "Start-up:
weights that view the checkpoint file"). The kernel can drop clean file pages under pressure, but a pod's memory, a
process's RSS and the page cache's share between processes all count them until then (the pages of the weights
that the packed layers copied are unmapped as each layer is built: core.mapped_pages). An eager model (loaded as
from_pretrained builds it, nothing packed) is left alone: its weights are the views.
"""

from __future__ import annotations

import torch

from tandem.core.mapped_pages import viewing_a_file


@torch.no_grad()
def copy_file_views(model: torch.nn.Module) -> int:
    """Give every parameter and buffer of `model` that views a file memory of its own; the bytes copied."""
    copied = 0
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None and viewing_a_file(tensor):
                tensor.data = tensor.data.clone()
                copied += tensor.numel() * tensor.element_size()
    return copied
