from __future__ import annotations

import torch

from swarmtrain.config import ModelConfig
from swarmtrain.model import ByteTransformer, count_parameters


def test_logits_are_causal() -> None:
    torch.manual_seed(0)
    model = ByteTransformer(ModelConfig(depth=2, width=32, heads=2, context=16)).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_exits_share_one_readout_by_default() -> None:
    shared = ByteTransformer(ModelConfig(depth=4, width=32, heads=2, context=8, exits=[1, 2]))
    separate = ByteTransformer(ModelConfig(depth=4, width=32, heads=2, context=8, exits=[1, 2], shared_readout=False))
    assert shared.readout_for(1) is shared.readout_for(4)
    assert separate.readout_for(1) is not separate.readout_for(4)
    assert count_parameters(separate) - count_parameters(shared) == 2 * 32 * 256
    h = shared.run_blocks(shared.embed_tokens(torch.zeros(1, 8, dtype=torch.long)), 0, 1)
    assert shared.exit_logits(h, 1).shape == (1, 8, 256)


def test_stages_compose_to_the_whole_model() -> None:
    model = ByteTransformer(ModelConfig(depth=4, width=32, heads=2, context=8)).eval()
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        h = model.run_blocks(model.embed_tokens(idx), 0, 2)
        h = model.run_blocks(h, 2, 4)
        torch.testing.assert_close(model.exit_logits(h, 4), model(idx))
