"""What makes a model an inference model: a copy of the model it was made from, in eval mode, its parameters needing no
gradient, training refused (`InferenceModule`), and a way for its fast paths to see that nothing was hooked or replaced
in it since it was made (`ModuleTree`).

The engine's functions (`optimize_for_inference`, `quantize_for_inference`, `compile_for_inference`) work on
`inference_copy(model)`: the model given stays as it was, plain and trainable, and nothing done to it afterwards
changes the inference model's answers.
"""

import copy
import functools
import itertools
import operator

from torch import nn
from torch.nn.modules import module as module_hooks
from transformers import PreTrainedModel

from .packed_linear import bound_onednn_caches

REFUSED = ("{what}: this is an inference model made by {engine}, whose weights were fixed then. Train (or load "
           "weights into) the model you passed to {engine}, then call {engine} again on it.")

CAPTURE_HOOK = "output_capturing_hook"  # transformers' hooks that record attention maps when asked (capture_outputs)


class InferenceModule:
    """Refuses what would train an inference model or change its weights: `.train()`, `requires_grad_(True)`,
    `load_state_dict`; `.eval()` is allowed. Saving it is refused too (`save_pretrained` would write the engine's
    classes into the folder): the model it was made from saves the same weights."""

    made_by: str  # the engine's function (`inference_copy`)

    def train(self, mode: bool = True):
        if mode:
            raise ValueError(self.refusal("train()"))
        return super().train(False)

    def requires_grad_(self, requires_grad: bool = True):
        if requires_grad:
            raise ValueError(self.refusal("requires_grad_(True)"))
        return super().requires_grad_(False)

    def load_state_dict(self, *args, **kwargs):
        raise ValueError(self.refusal("load_state_dict()"))

    def save_pretrained(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__}.save_pretrained(): this is an inference model made by {self.made_by}; "
                         f"save the model you passed to {self.made_by} (the same weights), and call {self.made_by} on "
                         "it where it is loaded")

    def refusal(self, call: str) -> str:
        return REFUSED.format(what=f"{type(self).__name__}.{call}", engine=self.made_by)


@functools.cache
def inference_class(cls: type) -> type:
    """`cls` with `InferenceModule`'s refusals, named after it."""
    if issubclass(cls, InferenceModule):
        return cls
    return type(f"Inference{cls.__name__}", (InferenceModule, cls), {"__module__": __name__})


def inference_copy(model: nn.Module, engine: str) -> nn.Module:
    """A copy of `model` made an inference model by the function `engine`: eval mode, no parameter needing gradients,
    every transformers model in it (the head and its base model) refusing training (`InferenceModule`), and every
    module refusing a state dict that holds its weights (`refuse_loads`). oneDNN's caches are bounded first
    (`bound_onednn_caches`)."""
    bound_onednn_caches(engine)
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    for module in frozen.modules():
        module.made_by = engine  # named by the refusals, of the modules that get them now or later
        refuse_loads(module, engine)
        if isinstance(module, PreTrainedModel):
            module.__class__ = inference_class(type(module))
    return frozen


def refuse_loads(module: nn.Module, engine: str) -> None:
    """`module` refuses a state dict with a value for one of its own parameters or buffers, whatever loads it: a
    wrapper's `load_state_dict` (PEFT's `PeftModel.from_pretrained` loading the classifier it trained) reaches the
    module without its `load_state_dict`. The engine's fast paths hold copies made at its call (packed or quantized
    weights, a compiled program), which such a load would leave as they were: a silent wrong answer. Adapter weights in
    modules added later (LoRA's) still load. A copy of the module (peft's `modules_to_save`) keeps the refusal."""
    names = [*module._parameters, *module._buffers]
    if not names:
        return

    def refuse(state_dict, prefix, *args):
        loaded = [prefix + name for name in names if prefix + name in state_dict]
        if loaded:
            raise ValueError(REFUSED.format(what=f"loading {loaded[0]}", engine=engine))

    module._register_load_state_dict_pre_hook(refuse)


class ModuleTree:
    """The modules below a root as they were when an inference path was built on them: `unchanged()` is False once a
    module or a parameter was replaced (PEFT's adapters, user code), a module set to training mode, a forward hook
    registered on one or for every module, or a `forward` patched onto one, so that the path steps aside and the
    modules run. transformers' own hooks that record attention maps are not counted (the paths step aside whenever
    those are asked for). Each look is a few comparisons of lists, in C: no Python step per module."""

    def __init__(self, root: nn.Module):
        modules = list(root.modules())
        # the live dicts that are not empty (a module given a child or parameter where it had none computes the same)
        self.children = [d for m in modules for d in (m._modules, m._parameters) if d]
        self.built = [dict(children) for children in self.children]
        self.hooks = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
        self.states = [m.__dict__ for m in modules]

    def unchanged(self) -> bool:
        if not self.same_children() or module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
            return False
        if any(map(TRAINING, self.states)) or any(map(dict.__contains__, self.states, itertools.repeat("forward"))):
            return False
        return not any(self.hooks) or all(getattr(hook, "__name__", None) == CAPTURE_HOOK
                                           for hooks in self.hooks for hook in hooks.values())

    def same_children(self) -> bool:
        """The same module and parameter objects under the same names. (Comparing dicts compares their values by
        identity first; a parameter replaced by another compares as a tensor, whose truth value raises.)"""
        try:
            return self.children == self.built
        except RuntimeError:
            return False


TRAINING = operator.itemgetter("training")
