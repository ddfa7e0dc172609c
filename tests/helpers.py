"""Helpers more than one test file uses."""

import contextlib
import sys

import torch


@contextlib.contextmanager
def layouts_built(model):
    """A list that gets one entry per forward of `model` in the block that ran the padding-free layout (a call on the
    padded path builds none): a spy on `UnpaddedLayout.build` of the model's own code (a `trust_remote_code` copy has
    its own), which changes nothing the model computes, unlike a hook."""
    layout_class = sys.modules[type(model.base_model).forward.__module__].UnpaddedLayout  # the module of its forward
    original = layout_class.__dict__["build"]
    built = []

    def build(cls, *args, **kwargs):
        built.append(args[2])  # the padded batch's (B, T)
        return original.__get__(None, cls)(*args, **kwargs)

    layout_class.build = classmethod(build)
    try:
        yield built
    finally:
        layout_class.build = original


def max_diff(a, b) -> float:
    """max |a - b| of two tensors (or what torch.as_tensor takes) of the same shape."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()
