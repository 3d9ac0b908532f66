"""`appliance tiny --shape slice` writes its random weights on the GPU when there is one: nothing in the
writer may meet a host tensor there (the writer runs here on the meta device, which refuses the same mix)."""

import torch

from appliance.cli import tiny_checkpoint as tiny


def test_the_slice_writer_keeps_every_tensor_on_the_generators_device(monkeypatch, tmp_path):
    written = {}

    class MetaWriter(tiny._Writer):
        def __init__(self, seed, block, device="cpu"):
            super().__init__(seed, block, "cpu")
            self.device = "meta"

        def randn(self, *shape, std=1.0):
            return torch.empty(*shape, device="meta") * std

        def __setitem__(self, name, value):
            assert value.device.type == "meta", name
            self.t[name] = value

    tokenizer = tiny.write_tokenizer
    monkeypatch.setattr(tiny, "_Writer", MetaWriter)
    monkeypatch.setattr(tiny, "save_file", lambda tensors, path: written.update(tensors))
    monkeypatch.setattr(tiny, "write_tokenizer", lambda path, vocab: tokenizer(path, 512))  # the slow part
    monkeypatch.setitem(tiny.SHAPES, "slice", dict(tiny.V41_SLICE, experts=2, dspark_experts=2))
    tiny._write_v41(tmp_path, 0, "slice")
    assert written["embed.weight"].shape == (129280, 5120)
    assert written["layers.3.ffn.experts.1.w1.weight"].dtype == torch.int8
