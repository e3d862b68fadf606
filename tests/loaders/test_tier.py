"""loaders.fast.tier: a batch's items admitted to the device tier as copies, one buffer a dtype."""

from __future__ import annotations

import torch

from loaders.fast.tier import ALIGN, DeviceTier, packed_copies


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.rand((1, 5, 7), generator=g), torch.rand((3,), generator=g), torch.rand((1, 4, 4), generator=g)]


def test_packed_copies_equal_their_tensors_in_one_buffer_each_aligned() -> None:
    tensors = _tensors()
    copies = packed_copies(tensors)
    assert all(torch.equal(c, t) and c.shape == t.shape and c.dtype == t.dtype for c, t in zip(copies, tensors))
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1  # one buffer
    assert all(c.data_ptr() % ALIGN == 0 for c in copies)
    tensors[0].fill_(7.0)  # copies, not views: the inputs' later writes do not reach them
    assert not torch.equal(copies[0], tensors[0])
    many = [torch.full((k % 5 + 1,), float(k)) for k in range(300)]  # more than one cat kernel's inputs on a GPU
    assert all(torch.equal(c, t) for c, t in zip(packed_copies(many), many))


def test_packed_copies_of_views_and_of_a_subclass() -> None:
    from monai.data import MetaTensor

    base = torch.arange(60, dtype=torch.int16).reshape(3, 4, 5)
    window = base[:, 1:3, ::2]  # not contiguous
    meta = MetaTensor(torch.ones(2, 3, dtype=torch.int16), meta={"filename_or_obj": "x.nii"})
    copies = packed_copies([window, meta, base[0]])
    assert torch.equal(copies[0], window) and copies[0].is_contiguous()
    assert isinstance(copies[1], MetaTensor) and copies[1].meta["filename_or_obj"] == "x.nii"  # cloned on its own
    assert copies[1].data_ptr() != meta.data_ptr() and torch.equal(copies[2], base[0])
    assert copies[0].untyped_storage().data_ptr() == copies[2].untyped_storage().data_ptr()
    assert packed_copies([window])[0].data_ptr() != window.data_ptr()  # one tensor: a clone


def test_admit_all_keeps_each_dtype_in_one_buffer_and_counts_the_bytes() -> None:
    tier = DeviceTier(1 << 20)
    image = _tensors()
    label = [torch.ones((1, 5, 7), dtype=torch.uint8), torch.zeros((3,), dtype=torch.uint8)]
    got = {10: {"image": image[0], "label": label[0]}, 11: {"image": image[1], "label": label[1]}}
    tier.admit_all(got, {10: 175, 11: 15})
    assert len(tier) == 2 and tier.nbytes == 190 and list(tier[10]) == ["image", "label"]
    for item, tensors in got.items():
        assert all(torch.equal(tier[item][k], t) for k, t in tensors.items())
    ptrs = {(k, tier[i][k].untyped_storage().data_ptr()) for i in (10, 11) for k in ("image", "label")}
    assert len(ptrs) == 2  # one buffer for the float images, one for the uint8 labels
    tier.admit_all({11: {"image": image[2], "label": label[1]}, 12: {"image": image[2]}}, {11: 99, 12: 64})
    assert torch.equal(tier[11]["image"], image[1]) and tier.nbytes == 254  # a held item is kept as it was
    tier.admit(13, {"image": image[0]}, 140)
    assert torch.equal(tier[13]["image"], image[0]) and tier.nbytes == 394
