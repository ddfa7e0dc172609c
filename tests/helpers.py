"""Helpers more than one test file uses."""

import contextlib
import sys


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
