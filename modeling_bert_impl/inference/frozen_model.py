"""What makes a model an inference model: a copy of the model it was made from, in eval mode, its parameters needing no
gradient, training refused (`InferenceModule`), its weights changed in place refused (`WeightsFixed`), and a way for its
fast paths to see that nothing was hooked or replaced in it since it was made (`ModuleTree`).

The engine's functions (`optimize_for_inference`, `quantize_for_inference`, `compile_for_inference`) work on
`inference_copy(model)`: the model given stays as it was, plain and trainable, and nothing done to it afterwards
changes the inference model's answers.
"""

import copy
import functools
import itertools
import operator

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from transformers import PreTrainedModel

from ..layouts import DEFINED_FORWARDS
from .native import snapshot
from .packed_linear import bound_onednn_caches
from .threads import size_threads

REFUSED = ("{what}: this is an inference model made by {engine}, whose weights were fixed then. Train (or load "
           "weights into) the model you passed to {engine}, then call {engine} again on it.")

CAPTURE_HOOK = "output_capturing_hook"  # transformers' hooks that record attention maps when asked (capture_outputs)
VERSION, DTYPE = operator.attrgetter("_version"), operator.attrgetter("dtype")  # of a tensor (`WeightsFixed`)


class InferenceModule:
    """Refuses what would train an inference model or change its weights: `.train()`, `requires_grad_(True)`,
    `load_state_dict`, and a call after a weight was changed in place (`WeightsFixed`); `.eval()` is allowed. Saving
    it is refused too (`save_pretrained` would write the engine's classes into the folder): the model it was made from
    saves the same weights."""

    made_by: str  # the engine's function (`inference_copy`)

    def __call__(self, *args, **kwargs):
        fixed = self.__dict__.get("weights_fixed")  # the engine's model only, not the base model inside a head
        if fixed is not None and not torch.compiler.is_compiling() and (name := fixed.changed()) is not None:
            raise ValueError(
                f"{type(self).__name__}: `{name}` was changed in place after {self.made_by} made this inference "
                "model, whose weights were fixed then (its fast paths hold their own copies of them, so its answers "
                f"would mix old weights and new). Change the model you passed to {self.made_by}, then call "
                f"{self.made_by} again on it")
        return super().__call__(*args, **kwargs)

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
    module refusing a state dict that holds its weights (`refuse_loads`). The fixed tensors of an inference model given
    (an int8 model compiled) are plain again until `fix_weights`: tracing takes no subclass. oneDNN's caches are bounded
    first (`bound_onednn_caches`), and torch's threads sized to the CPUs the process may use (`size_threads`)."""
    bound_onednn_caches(engine)
    size_threads(engine)
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    recast(frozen, PLAIN)
    for module in frozen.modules():
        module.made_by = engine  # named by the refusals, of the modules that get them now or later
        refuse_loads(module, engine)
        if isinstance(module, PreTrainedModel):
            module.__class__ = inference_class(type(module))
    return frozen


def fix_weights(model: nn.Module, native: bool = False) -> nn.Module:
    """`model`, an engine's finished inference model, refusing a call once a weight was changed in place
    (`WeightsFixed`; `native`: its first look in C++), through `.data` too (`FixedParameter`, `FixedBuffer`)."""
    recast(model, FIXED)
    model.weights_fixed = WeightsFixed.of(model, native)
    return model


def recast(model: nn.Module, classes: dict) -> None:
    """Each parameter and buffer of `model` whose class is a key of `classes` given the class it maps to, in place:
    the same objects, so what holds them (hooks, `ModuleTree`, the user's code) still does."""
    for module in model.modules():
        for tensor in itertools.chain(module._parameters.values(), module._buffers.values()):
            if type(tensor) in classes:
                tensor.__class__ = classes[type(tensor)]


class ReadOnlyToNumPy:
    """What an inference model's tensors, and the views of them it hands out, do beside a plain tensor's: NumPy gets
    a read-only array of them, so that a write through it (`p.detach().numpy()[:] += d`, `np.copyto(p.numpy(), w)`),
    which no version counter sees, is refused by NumPy ("assignment destination is read-only") instead of changing
    the weights some paths read and not the copies others hold (packed products, a compiled program). Their views
    (`.detach()`, `.data`, and what a view's own views and slices give: `FixedView`) do the same. `.data` shares the
    tensor's version counter, so that an in-place change through it (`p.data.mul_(2)`) is counted as one through the
    tensor is (torch's `.data` counts none); setting `.data` works as on any tensor."""

    def numpy(self, *, force: bool = False):
        array = torch.Tensor.numpy(self, force=force)
        array.flags.writeable = False
        return array

    def detach(self) -> "FixedView":
        return torch.Tensor.detach(self).as_subclass(FixedView)

    data = property(detach, torch.Tensor.data.__set__)


class FixedParameter(ReadOnlyToNumPy, nn.Parameter):
    """A parameter of an inference model: an `nn.Parameter` read-only to NumPy, whose `.data` is counted."""


class FixedBuffer(ReadOnlyToNumPy, torch.Tensor):
    """A buffer of an inference model: a plain tensor read-only to NumPy, whose `.data` is counted; torch's functions
    see a tensor (no `__torch_function__` step), and their results are plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __deepcopy__(self, memo):
        copied = self.as_subclass(torch.Tensor).clone()
        copied.__class__ = FixedBuffer
        memo[id(self)] = copied
        return copied


class FixedView(ReadOnlyToNumPy, torch.Tensor):
    """A view of an inference model's tensor, as `.detach()`, `.data` and `state_dict()` give it: read-only to NumPy,
    and so are its own views and slices (the results of torch's functions that share its memory); anything else
    torch makes from it is a plain tensor. Saved (pickled, `torch.save`) and deep-copied as a plain tensor. Only the
    user's code meets it: the inference model computes from its tensors themselves."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
            shares = isinstance(result, torch.Tensor) and result.untyped_storage().data_ptr() in {
                t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
        return result.as_subclass(FixedView) if shares else result

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        copied = memo[id(self)] = self.as_subclass(torch.Tensor).clone()
        return copied


FIXED = {nn.Parameter: FixedParameter, torch.Tensor: FixedBuffer}  # the tensors' classes in a finished inference model
PLAIN = {fixed: plain for plain, fixed in FIXED.items()}


class WeightsFixed:
    """The version and the storage of every parameter and buffer of an inference model when its engine finished.
    Changing one in place since (through the tensor under no_grad, as an optimizer step, `copy_` or `fill_` do; a new
    `.data` of the same dtype) changes them: `changed()` names it. A new dtype (`.double()`) is not a change here: the
    fast paths step aside for it and every answer comes from the converted weights. A parameter replaced by another
    object is not either: the fast paths step aside for it too (`ModuleTree`). A change through `.data`
    (`p.data.mul_(2)`) is counted: the engine's tensors are `FixedParameter`s and `FixedBuffer`s. Not seen: a change
    to a tensor made under torch.inference_mode() (which counts no version) inside that mode. A copy of the model
    (`copy.deepcopy`) starts from its weights then, and keeps a change found before.

    `native`: the versions and pointers looked at first in C++ (`native.snapshot`, where it is built), which answers
    "unchanged" in one call; where it does not, the look in Python decides."""

    def __init__(self, names: list[str], tensors: list, found: str | None = None, native: bool = False):
        self.names, self.tensors, self.found = names, tensors, found
        self.counted = [t for t in tensors if not t.is_inference()]  # the tensors with a version counter
        self.versions, self.pointers = self.read()
        self.dtypes = list(map(DTYPE, tensors))
        self.snapshot = snapshot(tensors=tensors) if native and found is None else None

    @classmethod
    def of(cls, model: nn.Module, native: bool = False) -> "WeightsFixed":
        named = list(itertools.chain(model.named_parameters(), model.named_buffers()))
        return cls([n for n, _ in named], [t for _, t in named], native=native)

    def read(self) -> tuple[list, list]:
        with torch._C.DisableTorchFunctionSubclass():  # a third of the time on the subclasses (no Python step there)
            return list(map(VERSION, self.counted)), list(map(torch.Tensor.data_ptr, self.tensors))

    def changed(self) -> str | None:
        """The name of the first tensor changed in place since, or None. One look at the versions and the storage
        pointers of the tensors, in C++ (`snapshot`) or else in C (each tensor apart only where one differs)."""
        if self.snapshot is not None and self.snapshot.same():
            return None
        if self.found is None and self.read() == (self.versions, self.pointers):
            return None
        versions = dict(zip(map(id, self.counted), self.versions))
        for name, t, pointer, dtype in zip(self.names, self.tensors, self.pointers, self.dtypes):
            moved = t.data_ptr() != pointer and t.dtype == dtype
            if self.found is None and (moved or (id(t) in versions and t._version != versions[id(t)])):
                self.found = name
        return self.found

    def __deepcopy__(self, memo):
        return WeightsFixed(self.names, [copy.deepcopy(t, memo) for t in self.tensors], self.changed(),
                            self.snapshot is not None)


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
    registered on one or for every module, or a `forward` set on one (accelerate's `add_hook_to_module` too), and
    False while the `forward` of one of the package's classes in it is not the one the package defined (a patch
    `BertImplSelfOutput.forward = f`, before the path was built or after), so that the path steps aside and the modules
    run. transformers' own hooks that record attention maps are not counted (the paths step aside whenever those are
    asked for). Each look is a few comparisons of lists, in C: no Python step per module. `native`: all it looks at
    compared first in C++ (`native.snapshot`, where it is built; taken while unchanged), which answers "unchanged" in
    one call where nothing it watches was touched."""

    def __init__(self, root: nn.Module, native: bool = False):
        modules = list(root.modules())
        # the package's classes among the modules' (their bases included), each with the forward it was defined with
        defined = {k: DEFINED_FORWARDS[k] for cls in set(map(type, modules)) for k in cls.__mro__
                   if k in DEFINED_FORWARDS}
        self.classes, self.forwards = list(defined), list(defined.values())
        # the live dicts that are not empty (a module given a child or parameter where it had none computes the same)
        self.children = [d for m in modules for d in (m._modules, m._parameters) if d]
        self.built = [dict(children) for children in self.children]
        self.hooks = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
        self.states = [m.__dict__ for m in modules]
        self.snapshot = None
        if native:
            self.snapshot = self.take_snapshot()

    def take_snapshot(self):
        """A `native.snapshot` of what `unchanged` reads (`watched`); None while it is False."""
        return snapshot(dicts=self.watched()) if self.looks_unchanged() else None

    def watched(self) -> list:
        """The dicts `unchanged` reads: each it compares, the attributes of each module, the namespace of each class,
        the global hooks and where torch keeps them."""
        hooks = [getattr(module_hooks, name) for name in GLOBAL_HOOKS]
        return [*self.children, *self.hooks, *self.states, *self.classes, *hooks, vars(module_hooks)]

    def __deepcopy__(self, memo):
        copied = copy.copy(self)
        copied.__dict__ = copy.deepcopy({**vars(self), "snapshot": None}, memo)
        if self.snapshot is not None:
            copied.snapshot = copied.take_snapshot()
        return copied

    def unchanged(self) -> bool:
        """Whether nothing was replaced, hooked, patched or set to training since: the snapshot's one look where it has
        one and sees nothing touched; else the look in Python, after which the snapshot is taken again where that
        finds nothing changed (a module's attribute set to the same value, a hook added and removed)."""
        if self.snapshot is None:
            return self.looks_unchanged()
        if self.snapshot.same():
            return True
        unchanged = self.looks_unchanged()
        if unchanged:
            self.snapshot.take()
        return unchanged

    def looks_unchanged(self) -> bool:
        if not self.same_children() or module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
            return False
        if list(map(FORWARD, map(vars, self.classes))) != self.forwards:  # by identity first: functions compare so
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


GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")  # torch's hooks for every module
TRAINING = operator.itemgetter("training")
FORWARD = operator.methodcaller("get", "forward")  # of a class's namespace
