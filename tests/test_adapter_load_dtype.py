"""Every adapter loads a checkpoint with the dtype keyword that every diffusers in the declared range
honours, ``torch_dtype=`` (issue 36, item 10): diffusers before 0.36 ignores ``dtype=`` and would load
Wan2.1-14B in fp32 (56 GB). The checkpoint loaders are replaced by recorders, so no checkpoint is needed:
what is checked is the keyword each ``from_pretrained`` call receives (on 849bed7 Wan passed ``dtype=``)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from digenrl.adapters import ADAPTERS, adapter_class


@pytest.mark.parametrize("family", sorted(ADAPTERS))
@pytest.mark.parametrize("transformer_alone", [False, True])
def test_from_pretrained_gets_torch_dtype(family, transformer_alone, tmp_path):
    import diffusers

    (tmp_path / "model_index.json").write_text("{}")
    calls = []

    def recorder(kind):
        def from_pretrained(*args, **kwargs):
            calls.append((kind, kwargs))
            return mock.MagicMock()

        return from_pretrained

    cls = adapter_class(family)
    adapter = cls.__new__(cls)  # only what the loaders read: no model is built
    adapter.dtype, adapter.device = torch.bfloat16, torch.device("cpu")
    adapter.model, adapter.sampling = mock.MagicMock(), mock.MagicMock()
    with (
        mock.patch.object(diffusers.DiffusionPipeline, "from_pretrained", recorder("pipeline")),
        mock.patch.object(diffusers.ModelMixin, "from_pretrained", recorder("model")),
        mock.patch.object(cls, "place_pipe", lambda self: None),
    ):
        try:  # a lean trainer rank loads the transformer alone (Adapter.build_transformer_alone)
            (adapter.build_transformer_alone if transformer_alone else adapter.build_pretrained)(tmp_path)
        except Exception:  # past the loads, the recorders' stand-ins are not real modules
            pass
    assert calls, f"{family}: build_pretrained loaded nothing"
    for kind, kwargs in calls:
        assert "dtype" not in kwargs, f"{family}: {kind} loaded with dtype= (ignored by diffusers < 0.36)"
        assert "torch_dtype" in kwargs, f"{family}: {kind} loaded without torch_dtype"
        if kind == "pipeline":
            assert kwargs["torch_dtype"] == torch.bfloat16
