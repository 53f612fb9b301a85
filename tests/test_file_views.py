"""A loaded model keeps no view of its checkpoint file (models.file_views): the mapping, and every page of the file
the load read, would otherwise stay in the process's memory."""

from __future__ import annotations

import mmap

import pytest
import torch
from safetensors import safe_open

from tandem.models.file_views import copy_file_views, viewing_a_file
from tandem.models.loader import load_model


def file_backed_mapping_kib(path: str) -> int:
    """The resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                resident += int(fields[1])
    return resident


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_model_views_no_file_and_its_checkpoint_is_unmapped(tiny_dirs, dtype) -> None:
    """The tiny models are stored in float32: loaded so, from_pretrained leaves their weights as views of the
    mapped file (checked below through safetensors itself; its layers are too small to be packed in float32); the
    loader copies them out (planted: without copy_file_views, views remain and the file stays mapped). An eager load
    keeps them: there the views are the weights, and copies would only double them."""
    weights = str(tiny_dirs.target / "model.safetensors")
    with safe_open(weights, framework="pt") as checkpoint:
        assert viewing_a_file(checkpoint.get_tensor(next(iter(checkpoint.keys()))))
    loaded = load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=dtype, progress=False)
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert tensors and not any(viewing_a_file(tensor) for tensor in tensors)
    assert file_backed_mapping_kib(weights) == 0
    x = torch.tensor([[3, 4, 5]])
    assert torch.isfinite(loaded.model(x).logits).all()
    if dtype == torch.float32:
        eager = load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=dtype, progress=False, eager=True)
        assert any(viewing_a_file(tensor) for tensor in eager.model.parameters())


def test_copying_keeps_values_and_ties(tmp_path) -> None:
    path = tmp_path / "weights"
    values = torch.arange(64, dtype=torch.float32)
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    view = torch.frombuffer(mapped, dtype=torch.float32)
    assert viewing_a_file(view) and not viewing_a_file(values.clone())
    embedding = torch.nn.Embedding(8, 8)
    embedding.weight = torch.nn.Parameter(view.reshape(8, 8), requires_grad=False)
    head = torch.nn.Linear(8, 8, bias=False)
    head.weight = embedding.weight  # tied: one parameter, copied once
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    assert copy_file_views(model) == 64 * 4
    assert head.weight is embedding.weight and not viewing_a_file(embedding.weight)
    assert torch.equal(embedding.weight.reshape(-1), values)
    del view
    mapped.close()  # no tensor views it any more
