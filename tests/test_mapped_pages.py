"""A packed layer gives back the checkpoint file's pages its weight was read from (core.mapped_pages): the pages
leave the process's resident memory at once, the values stay readable, and nothing another tensor still uses, or
that is not a file's mapping, is touched."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tandem.core.mapped_pages import MappedWeights, viewing_a_file
from tandem.core.packed_linear import PackedLinear, prepack, supported
from test_file_views import file_backed_mapping_kib

WIDTH = 1024  # a float32 [1024 x 1024] layer: 4 MiB, as many weights as prepack packs in float32


def mapped_weights(path: Path, count: int) -> tuple[mmap.mmap, list[torch.Tensor], torch.Tensor]:
    """`count` [WIDTH x WIDTH] float32 weights written to `path` and viewed through a private mapping of it (as
    safetensors maps a checkpoint), every page read once; the mapping, the views and the values written."""
    values = torch.randn(count, WIDTH, WIDTH)
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    views = list(torch.frombuffer(mapped, dtype=torch.float32).reshape(count, WIDTH, WIDTH).unbind())
    assert all(viewing_a_file(view) for view in views) and float(sum(view.sum() for view in views)) != 0.0
    return mapped, views, values


def linear_on(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(*weight.shape[::-1], bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def test_a_dropped_layers_weight_is_unmapped_and_still_reads_its_values(tmp_path) -> None:
    path = tmp_path / "weights"
    mapped, (kept, consumed), values = mapped_weights(path, 2)
    model = torch.nn.ModuleDict({"kept": linear_on(kept), "consumed": linear_on(consumed)})
    weights = MappedWeights(model)
    before = file_backed_mapping_kib(str(path))
    assert before >= 2 * WIDTH * WIDTH * 4 // 1024 - 8
    released = weights.dropped(model.pop("consumed"))
    assert released >= WIDTH * WIDTH * 4 - mmap.PAGESIZE and released % mmap.PAGESIZE == 0
    assert file_backed_mapping_kib(str(path)) <= before - released // 1024
    assert torch.equal(consumed, values[1]) and torch.equal(kept, values[0])  # read again from the file
    del kept, consumed, model
    mapped.close()


def test_a_weight_the_model_still_holds_or_in_anonymous_memory_is_left_alone(tmp_path) -> None:
    """A head tied to the embedding gives up its weight, which the embedding still reads: not released (until the
    embedding goes too). A buffer's memory (not a file) would be zeroed by the same call: never released."""
    path = tmp_path / "weights"
    mapped, (shared,), _ = mapped_weights(path, 1)
    embedding = torch.nn.Embedding(WIDTH, WIDTH)
    embedding.weight = torch.nn.Parameter(shared, requires_grad=False)
    head = linear_on(shared)
    head.weight = embedding.weight
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    weights = MappedWeights(model)
    before = file_backed_mapping_kib(str(path))
    assert weights.dropped(model.pop("head")) == 0 and file_backed_mapping_kib(str(path)) == before
    assert weights.dropped(model.pop("embedding")) > 0 and file_backed_mapping_kib(str(path)) < before
    memory = bytearray(torch.randn(WIDTH, WIDTH).numpy().tobytes())
    anonymous = torch.frombuffer(memory, dtype=torch.float32).reshape(WIDTH, WIDTH)
    copy = anonymous.clone()
    model = torch.nn.ModuleDict({"layer": linear_on(anonymous)})
    assert viewing_a_file(anonymous) and MappedWeights(model).dropped(model.pop("layer")) == 0
    assert torch.equal(anonymous, copy)
    del shared, embedding, head
    mapped.close()


@pytest.mark.skipif(not supported(torch.float32), reason="oneDNN does not pack float32 on this CPU")
def test_prepack_unmaps_the_pages_of_the_layers_it_packs_and_keeps_their_products(tmp_path) -> None:
    """q/k/v become one fused product (core.fused_linear), o_proj a PackedLinear (replace_linears): each gives back
    its weight's pages as it is built; the model's outputs are what the views' were."""
    path = tmp_path / "weights"
    mapped, views, _ = mapped_weights(path, 4)
    block = torch.nn.Module()
    for name, view in zip(("q_proj", "k_proj", "v_proj", "o_proj"), views, strict=True):
        setattr(block, name, linear_on(view))
    x = torch.randn(3, WIDTH)
    expected = [getattr(block, name)(x) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    before = file_backed_mapping_kib(str(path))
    assert prepack(block) == 4 and isinstance(block.o_proj, PackedLinear)
    assert file_backed_mapping_kib(str(path)) <= before - 4 * (WIDTH * WIDTH * 4 // 1024 - 8)
    for name, want in zip(("q_proj", "k_proj", "v_proj", "o_proj"), expected, strict=True):
        torch.testing.assert_close(getattr(block, name)(x), want, rtol=1e-4, atol=1e-4)
    del views, block
    mapped.close()
