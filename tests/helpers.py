"""What many test files share: whether CUDA is here, the `gpu` mark, random prompts and the token ids
of a batch of outputs."""
import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()


def gpu(fn):
    """A test that needs a CUDA device: marked `gpu` (selected with -m gpu) and skipped without one."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs CUDA")(fn))


def prompts(lengths, seed=0):
    """One random prompt of token ids per length, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]
