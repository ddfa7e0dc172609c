// What a compiled model's call checks before its program runs, and the run, in C++ (native.py builds it;
// compiled_encoder.py and frozen_model.py use it). Right after the program has streamed the weights through the
// caches, every Python step waits on memory, one miss after another: a single query's checks in Python took longer
// than ONNX Runtime's whole call adds to its run. Here the loads of different objects do not depend on each other, so
// the CPU overlaps their misses, and a dict is looked at through its version tag (one load) where CPython keeps one.
//
// Snapshot(tensors, dicts): .same() -> bool, .take()
//   tensors: each keeps its data pointer and (where it has one) its version counter's value;
//   dicts: dicts, or classes (their namespace); each keeps its version tag (CPython 3.10-3.13, checked to change on
//   every write when the module loads: `versions`), else its keys and values by identity, in order.
//   same(): True where all of them are as they were taken; False says only "look again" (the Python checks decide).
//   take(): take them again as they are now. A deep copy is None (what holds it takes its own).
//
// SingleQuery(snapshots, by_shape, vocab_size, type_vocab_size, max_length, max_tokens)(args, kwargs)
//     -> ([ids, mask, token types, positions], padding) or None, for a model call's args and kwargs
//   The program's inputs for a call that is a single query: input_ids (1, T) int64 on the CPU, contiguous,
//   2 <= T <= max_length and T <= max_tokens, each id in [0, vocab_size); attention_mask None or (1, T) of 0s and 1s
//   (int64, int32, bool or float32, contiguous) whose n >= 2 ones are contiguous (a query padded to a fixed length,
//   on the right or the left): the inputs are then those n tokens (1, n), their positions kept, and padding (before,
//   after) the padding's length on each side, to put back around the program's hidden states (None without padding:
//   the inputs are (1, T)); token_type_ids None or (1, T) int64 in [0, type_vocab_size); no positions or embeddings;
//   at most those five positionally (forward's order), and of other keywords only those `call_inputs` lets by; each of
//   the snapshots the same; the shape's constants in `by_shape` ((1, T) -> (positions, zeros, ones),
//   CompiledEncoder.constants). None for every other call: the model's own checks (compiled_encoder.py:
//   program_inputs) decide it, which take every call this takes, with the same inputs.
//
// Program(package_path, runners=1)(inputs) -> outputs
//   An AOTInductor package's program, as torch._inductor.aoti_load_package loads it, run on a list of tensors with the
//   GIL released: torch's own binding holds it for the whole run, so a server's event loop (or any other Python
//   thread) stood still while a batch ran. `runners` calls run at once, from as many threads (AOTInductor's container
//   holds that many instances of the model, sharing its weights); more take turns. Built with RUNNERS_ARGUMENT
//   defined where torch's loader takes the count (the torch releases that compile, native.py), else one.
//   RuntimeError with AOTInductor's message where the package does not load or the inputs do not fit.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

#if PY_VERSION_HEX < 0x030E0000
bool versions = false;  // set when the module loads, where a dict's version tag changes on every write
uint64_t version(PyObject* dict) { return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag; }
#else
constexpr bool versions = false;
uint64_t version(PyObject*) { return 0; }
#endif

struct Tensor {
  c10::TensorImpl* impl;  // alive while `held` holds its Python object (set_data changes the impl in place)
  const void* data;
  bool stored;  // false: a tensor without storage (an opaque one), whose data is not looked at
  uint32_t version;
  bool counted;  // inference tensors have no version counter
};

struct Dict {
  PyObject* dict;
  uint64_t version;
  size_t first, count;  // without versions: its keys and values, alternating, in `items`
};

struct Snapshot {
  PyObject_HEAD
  std::vector<Tensor>* tensors;
  std::vector<Dict>* dicts;
  std::vector<PyObject*>* items;
  PyObject* held;  // a list of the tensors and dicts, so that none is freed (and its address reused) while watched
  PyObject* held_items;  // a list of `items`, likewise
};

bool same_contents(const Snapshot* self, const Dict& d) {
  if (static_cast<size_t>(PyDict_GET_SIZE(d.dict)) * 2 != d.count) return false;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  PyObject* const* item = self->items->data() + d.first;
  while (PyDict_Next(d.dict, &pos, &key, &value)) {
    if (key != item[0] || value != item[1]) return false;
    item += 2;
  }
  return true;
}

bool same(const Snapshot* self) {
  if (self->tensors == nullptr) return false;  // cleared by the garbage collector
  for (const Tensor& t : *self->tensors) __builtin_prefetch(t.impl);
  for (const Dict& d : *self->dicts) __builtin_prefetch(d.dict);
  bool same = true;
  for (const Tensor& t : *self->tensors) {
    same &= t.impl->has_storage() == t.stored && (!t.stored || t.impl->data() == t.data);
    same &= !t.counted || t.impl->version_counter().current_version() == t.version;
  }
  if (versions) {
    for (const Dict& d : *self->dicts) same &= version(d.dict) == d.version;
    return same;
  }
  if (!same) return false;
  for (const Dict& d : *self->dicts) {
    if (!same_contents(self, d)) return false;
  }
  return true;
}

PyObject* none(PyObject*, PyObject*) { Py_RETURN_NONE; }

PyObject* snapshot_same(PyObject* self, PyObject*) {
  return PyBool_FromLong(same(reinterpret_cast<Snapshot*>(self)));
}

// Each tensor's pointer and version and each dict's version (or contents) as they are now.
bool take(Snapshot* self) {
  PyObject* items = PyList_New(0);
  if (items == nullptr) return false;
  self->items->clear();
  for (Tensor& t : *self->tensors) {
    t.stored = t.impl->has_storage();
    t.data = t.stored ? t.impl->data() : nullptr;
    t.version = t.counted ? t.impl->version_counter().current_version() : 0;
  }
  for (Dict& d : *self->dicts) {
    d.version = version(d.dict);
    d.first = self->items->size();
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (!versions && PyDict_Next(d.dict, &pos, &key, &value)) {
      self->items->push_back(key);
      self->items->push_back(value);
      if (PyList_Append(items, key) < 0 || PyList_Append(items, value) < 0) {
        Py_DECREF(items);
        return false;
      }
    }
    d.count = self->items->size() - d.first;
  }
  Py_XSETREF(self->held_items, items);
  return true;
}

PyObject* snapshot_take(PyObject* self, PyObject*) {
  if (reinterpret_cast<Snapshot*>(self)->tensors == nullptr || !take(reinterpret_cast<Snapshot*>(self)))
    return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_RuntimeError, "the snapshot was cleared");
  Py_RETURN_NONE;
}

PyObject* build(Snapshot* self, PyObject* tensors, PyObject* dicts) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
    PyObject* object = PyList_GET_ITEM(tensors, i);
    if (!THPVariable_Check(object)) return PyErr_Format(PyExc_TypeError, "tensors[%zd] is not a tensor", i);
    c10::TensorImpl* impl = THPVariable_Unpack(object).unsafeGetTensorImpl();
    self->tensors->push_back({impl, nullptr, false, 0, !impl->is_inference()});
    if (PyList_Append(self->held, object) < 0) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dicts); i++) {
    PyObject* dict = PyList_GET_ITEM(dicts, i);
    if (PyType_Check(dict)) dict = reinterpret_cast<PyTypeObject*>(dict)->tp_dict;  // a class's own namespace
    if (dict == nullptr || !PyDict_Check(dict))
      return PyErr_Format(PyExc_TypeError, "dicts[%zd] is neither a dict nor a class", i);
    self->dicts->push_back({dict, 0, 0, 0});
    if (PyList_Append(self->held, dict) < 0) return nullptr;
  }
  return take(self) ? reinterpret_cast<PyObject*>(self) : nullptr;
}

void release(Snapshot* self) {
  delete self->tensors;
  delete self->dicts;
  delete self->items;
  self->tensors = nullptr;
  self->dicts = nullptr;
  self->items = nullptr;
}

int snapshot_clear(PyObject* object) {
  auto* self = reinterpret_cast<Snapshot*>(object);
  release(self);
  Py_CLEAR(self->held);
  Py_CLEAR(self->held_items);
  return 0;
}

int snapshot_traverse(PyObject* object, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<Snapshot*>(object)->held);
  Py_VISIT(reinterpret_cast<Snapshot*>(object)->held_items);
  return 0;
}

// tp_dealloc of a garbage-collected type whose references `Clear` drops (its tp_clear).
template <inquiry Clear>
void dealloc(PyObject* object) {
  PyObject_GC_UnTrack(object);
  Clear(object);
  Py_TYPE(object)->tp_free(object);
}

PyObject* snapshot_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *tensors, *dicts;
  static const char* names[] = {"tensors", "dicts", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!", const_cast<char**>(names), &PyList_Type, &tensors,
                                   &PyList_Type, &dicts))
    return nullptr;
  auto* self = reinterpret_cast<Snapshot*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->tensors = new std::vector<Tensor>();
  self->dicts = new std::vector<Dict>();
  self->items = new std::vector<PyObject*>();
  self->held = PyList_New(0);
  PyObject* built = self->held == nullptr ? nullptr : build(self, tensors, dicts);
  if (built == nullptr) Py_DECREF(self);
  return built;
}

PyMethodDef snapshot_methods[] = {
    {"same", snapshot_same, METH_NOARGS, "Whether every tensor and dict is as it was when the snapshot was taken."},
    {"take", snapshot_take, METH_NOARGS, "Take it again: every tensor and dict as it is now."},
    {"__deepcopy__", none, METH_O, "None: a copy of what holds it takes its own."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject SnapshotType = {PyVarObject_HEAD_INIT(nullptr, 0) "quick_call.Snapshot"};

struct SingleQuery {
  PyObject_HEAD
  PyObject* snapshots;  // a tuple of Snapshots
  PyObject* by_shape;
  int64_t vocab, types, max_length, max_tokens;
};

// A plain tensor (1, T) of `dtype` on the CPU, contiguous; T where it is, else -1.
int64_t row(PyObject* object, c10::ScalarType dtype) {
  if (!THPVariable_CheckExact(object)) return -1;
  const at::Tensor& t = THPVariable_Unpack(object);
  if (t.layout() != c10::kStrided || t.dim() != 2 || t.size(0) != 1 || t.scalar_type() != dtype ||
      !t.device().is_cpu() || !t.is_contiguous() || !t.has_storage())
    return -1;
  return t.size(1);
}

bool within(PyObject* object, int64_t size) {  // each value of a `row` of int64 in [0, size)
  const at::Tensor& t = THPVariable_Unpack(object);
  const int64_t* values = t.const_data_ptr<int64_t>();
  bool inside = true;
  for (int64_t i = 0; i < t.numel(); i++) inside &= static_cast<uint64_t>(values[i]) < static_cast<uint64_t>(size);
  return inside;
}

// The real tokens of a mask of 0s and 1s whose 1s are contiguous, as [start, start + count); false for another.
template <typename T>
bool ones_in_a_run(const at::Tensor& t, int64_t* start, int64_t* count) {
  const T* values = t.const_data_ptr<T>();
  int64_t first = -1, last = -1;
  bool binary = true;
  for (int64_t i = 0; i < t.numel(); i++) {
    binary &= values[i] == T(0) || values[i] == T(1);
    if (values[i] == T(1)) {
      first = first < 0 ? i : first;
      last = i;
    }
  }
  if (!binary || first < 0) return false;
  for (int64_t i = first; i <= last; i++) {
    if (values[i] != T(1)) return false;
  }
  *start = first;
  *count = last - first + 1;
  return true;
}

// A mask (1, length), of a dtype a tokenizer gives, whose real tokens are one run [start, start + count).
bool mask_run(PyObject* object, int64_t length, int64_t* start, int64_t* count) {
  for (c10::ScalarType dtype : {c10::kLong, c10::kInt, c10::kBool, c10::kFloat}) {
    if (row(object, dtype) != length) continue;
    const at::Tensor& t = THPVariable_Unpack(object);
    switch (dtype) {
      case c10::kLong: return ones_in_a_run<int64_t>(t, start, count);
      case c10::kInt: return ones_in_a_run<int32_t>(t, start, count);
      case c10::kBool: return ones_in_a_run<bool>(t, start, count);
      default: return ones_in_a_run<float>(t, start, count);
    }
  }
  return false;
}

// `object`'s tokens [start, start + count): itself where that is all of them, else a view (a new reference).
PyObject* tokens(PyObject* object, int64_t start, int64_t count) {
  const at::Tensor& t = THPVariable_Unpack(object);
  if (start == 0 && count == t.size(1)) return Py_NewRef(object);
  return THPVariable_Wrap(t.narrow(1, start, count));
}

constexpr const char* INPUTS[] = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds"};

// The call's five inputs (`INPUTS`: Py_None where not given), from its positional arguments and keywords; false for a
// call with more positional arguments, an input given twice, or another keyword than return_dict (any),
// output_attentions and output_hidden_states (None or False), label_checks and pool_with (None).
bool call_inputs(PyObject* args, PyObject* kwargs, PyObject* inputs[5]) {
  Py_ssize_t given = PyTuple_GET_SIZE(args);
  if (given > 5) return false;
  for (Py_ssize_t i = 0; i < 5; i++) inputs[i] = i < given ? PyTuple_GET_ITEM(args, i) : Py_None;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(kwargs, &pos, &key, &value)) {
    const char* name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : nullptr;
    if (name == nullptr) return false;
    int input = -1;
    for (int i = 0; i < 5; i++) input = std::strcmp(name, INPUTS[i]) == 0 ? i : input;
    if (input >= 0) {
      if (input < given) return false;  // given twice: Python's call names the error
      inputs[input] = value;
      continue;
    }
    if (std::strcmp(name, "return_dict") == 0) continue;
    bool off = value == Py_None || value == Py_False;
    bool may_be_false = std::strcmp(name, "output_attentions") == 0 || std::strcmp(name, "output_hidden_states") == 0;
    bool must_be_none = std::strcmp(name, "label_checks") == 0 || std::strcmp(name, "pool_with") == 0;
    if (!((may_be_false && off) || (must_be_none && value == Py_None))) return false;
  }
  return true;
}

PyObject* query_call(PyObject* object, PyObject* args, PyObject* kwargs_of_call) {
  auto* self = reinterpret_cast<SingleQuery*>(object);
  PyObject *call_args, *call_kwargs, *inputs_given[5];
  if (kwargs_of_call != nullptr || !PyArg_UnpackTuple(args, "SingleQuery", 2, 2, &call_args, &call_kwargs))
    return kwargs_of_call != nullptr ? PyErr_Format(PyExc_TypeError, "SingleQuery takes 2 positional arguments")
                                     : nullptr;
  if (!PyTuple_Check(call_args) || !PyDict_Check(call_kwargs))
    return PyErr_Format(PyExc_TypeError, "SingleQuery takes a call's (args, kwargs): a tuple and a dict");
  if (!call_inputs(call_args, call_kwargs, inputs_given)) Py_RETURN_NONE;
  PyObject *ids = inputs_given[0], *mask = inputs_given[1], *token_types = inputs_given[2];
  if (inputs_given[3] != Py_None || inputs_given[4] != Py_None) Py_RETURN_NONE;  // positions, embeddings
  int64_t length = row(ids, c10::kLong), start = 0, count = length;
  if (length < 2 || length > self->max_length || length > self->max_tokens) Py_RETURN_NONE;
  if (mask != Py_None && (!mask_run(mask, length, &start, &count) || count < 2)) Py_RETURN_NONE;
  if (token_types != Py_None && (row(token_types, c10::kLong) != length || !within(token_types, self->types)))
    Py_RETURN_NONE;
  if (!within(ids, self->vocab)) Py_RETURN_NONE;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->snapshots); i++) {
    if (!same(reinterpret_cast<Snapshot*>(PyTuple_GET_ITEM(self->snapshots, i)))) Py_RETURN_NONE;
  }
  PyObject* key = Py_BuildValue("(iL)", 1, static_cast<long long>(length));
  if (key == nullptr) return nullptr;
  PyObject* constants = PyDict_GetItemWithError(self->by_shape, key);  // borrowed: (positions, zeros, ones)
  Py_DECREF(key);
  if (constants == nullptr) return PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  if (!PyTuple_Check(constants) || PyTuple_GET_SIZE(constants) != 3)
    return PyErr_Format(PyExc_TypeError, "by_shape[(1, %lld)] is not (positions, zeros, ones)", (long long)length);
  PyObject* types = token_types != Py_None ? token_types : PyTuple_GET_ITEM(constants, 1);
  PyObject* inputs = PyList_New(4);
  if (inputs == nullptr) return nullptr;
  PyObject* given[4] = {ids, PyTuple_GET_ITEM(constants, 2), types, PyTuple_GET_ITEM(constants, 0)};
  for (int i = 0; i < 4; i++) {
    PyObject* part = tokens(given[i], start, count);
    if (part == nullptr) {
      Py_DECREF(inputs);
      return nullptr;
    }
    PyList_SET_ITEM(inputs, i, part);
  }
  if (count == length) return Py_BuildValue("(NO)", inputs, Py_None);
  return Py_BuildValue("(N(LL))", inputs, static_cast<long long>(start), static_cast<long long>(length - start - count));
}

int query_clear(PyObject* object) {
  auto* self = reinterpret_cast<SingleQuery*>(object);
  Py_CLEAR(self->snapshots);
  Py_CLEAR(self->by_shape);
  return 0;
}

int query_traverse(PyObject* object, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<SingleQuery*>(object);
  Py_VISIT(self->snapshots);
  Py_VISIT(self->by_shape);
  return 0;
}

PyObject* query_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *snapshots, *by_shape;
  long long vocab, types, max_length, max_tokens;
  static const char* names[] = {"snapshots", "by_shape", "vocab_size", "type_vocab_size", "max_length", "max_tokens",
                                nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!LLLL", const_cast<char**>(names), &PyTuple_Type, &snapshots,
                                   &PyDict_Type, &by_shape, &vocab, &types, &max_length, &max_tokens))
    return nullptr;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(snapshots); i++) {
    if (!PyObject_TypeCheck(PyTuple_GET_ITEM(snapshots, i), &SnapshotType))
      return PyErr_Format(PyExc_TypeError, "snapshots[%zd] is not a Snapshot", i);
  }
  auto* self = reinterpret_cast<SingleQuery*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  Py_INCREF(snapshots);
  Py_INCREF(by_shape);
  self->snapshots = snapshots;
  self->by_shape = by_shape;
  self->vocab = vocab;
  self->types = types;
  self->max_length = max_length;
  self->max_tokens = max_tokens;
  return reinterpret_cast<PyObject*>(self);
}

PyMethodDef query_methods[] = {{"__deepcopy__", none, METH_O, "None: a copy of the model takes its own."},
                               {nullptr, nullptr, 0, nullptr}};

PyTypeObject SingleQueryType = {PyVarObject_HEAD_INIT(nullptr, 0) "quick_call.SingleQuery"};

struct Program {
  PyObject_HEAD
  torch::inductor::AOTIModelPackageLoader* loader;
};

PyObject* program_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  const char* path;
  Py_ssize_t runners = 1;
  static const char* names[] = {"package_path", "runners", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|n", const_cast<char**>(names), &path, &runners)) return nullptr;
  if (runners < 1) return PyErr_Format(PyExc_ValueError, "runners: %zd, at least 1", runners);
  auto* self = reinterpret_cast<Program*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  try {
#ifdef RUNNERS_ARGUMENT
    self->loader = new torch::inductor::AOTIModelPackageLoader(path, "model", false, static_cast<size_t>(runners));
#else
    self->loader = new torch::inductor::AOTIModelPackageLoader(path);
#endif
  } catch (const std::exception& error) {
    Py_DECREF(self);
    return PyErr_Format(PyExc_RuntimeError, "%s: %s", path, error.what());
  }
  return reinterpret_cast<PyObject*>(self);
}

PyObject* program_call(PyObject* object, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<Program*>(object);
  PyObject* given;
  if (kwargs != nullptr || !PyArg_ParseTuple(args, "O!", &PyList_Type, &given))
    return kwargs != nullptr ? PyErr_Format(PyExc_TypeError, "Program takes one list of tensors") : nullptr;
  std::vector<at::Tensor> inputs;
  inputs.reserve(PyList_GET_SIZE(given));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(given); i++) {
    PyObject* item = PyList_GET_ITEM(given, i);
    if (!THPVariable_Check(item)) return PyErr_Format(PyExc_TypeError, "inputs[%zd] is not a tensor", i);
    inputs.push_back(THPVariable_Unpack(item));
  }
  std::vector<at::Tensor> outputs;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  try {
    outputs = self->loader->boxed_run(std::move(inputs));
  } catch (const std::exception& e) {
    error = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) return PyErr_Format(PyExc_RuntimeError, "%s", error.c_str());
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(outputs.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < outputs.size(); i++) {
    PyObject* tensor = THPVariable_Wrap(std::move(outputs[i]));
    if (tensor == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), tensor);
  }
  return out;
}

void program_dealloc(PyObject* object) {
  delete reinterpret_cast<Program*>(object)->loader;
  Py_TYPE(object)->tp_free(object);
}

PyTypeObject ProgramType = {PyVarObject_HEAD_INIT(nullptr, 0) "quick_call.Program"};

#if PY_VERSION_HEX < 0x030E0000
// Whether this interpreter's dicts change their version tag on every write: an item set, replaced and deleted, and an
// object's attribute set through its materialized __dict__ (as a module's are).
bool versions_change() {
  PyObject* dict = PyDict_New();
  PyObject* type = dict == nullptr ? nullptr
                                   : PyObject_CallFunction(reinterpret_cast<PyObject*>(&PyType_Type), "s()O",
                                                           "Probe", dict);
  PyObject* probe = type == nullptr ? nullptr : PyObject_CallNoArgs(type);
  PyObject* attributes = probe == nullptr ? nullptr : PyObject_GetAttrString(probe, "__dict__");
  bool changes = attributes != nullptr && PyDict_Check(attributes);
  if (changes) {
    uint64_t seen[5] = {version(dict), 0, 0, 0, version(attributes)};
    PyDict_SetItemString(dict, "a", Py_None);
    seen[1] = version(dict);
    PyDict_SetItemString(dict, "a", Py_True);
    seen[2] = version(dict);
    PyDict_DelItemString(dict, "a");
    seen[3] = version(dict);
    PyObject_SetAttrString(probe, "a", Py_None);
    changes = seen[0] != seen[1] && seen[1] != seen[2] && seen[2] != seen[3] && version(attributes) != seen[4];
  }
  PyErr_Clear();
  Py_XDECREF(attributes);
  Py_XDECREF(probe);
  Py_XDECREF(type);
  Py_XDECREF(dict);
  return changes;
}
#else
bool versions_change() { return false; }
#endif

PyModuleDef module = {PyModuleDef_HEAD_INIT, "quick_call", "What a compiled model's call checks and runs, in C++.", -1,
                      nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_quick_call() {
  SnapshotType.tp_basicsize = sizeof(Snapshot);
  SnapshotType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  SnapshotType.tp_doc = "Snapshot(tensors, dicts): see quick_call.cpp";
  SnapshotType.tp_new = snapshot_new;
  SnapshotType.tp_dealloc = dealloc<snapshot_clear>;
  SnapshotType.tp_traverse = snapshot_traverse;
  SnapshotType.tp_clear = snapshot_clear;
  SnapshotType.tp_methods = snapshot_methods;
  SingleQueryType.tp_basicsize = sizeof(SingleQuery);
  SingleQueryType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  SingleQueryType.tp_doc = "SingleQuery(snapshots, by_shape, vocab_size, type_vocab_size, max_length, max_tokens)";
  SingleQueryType.tp_new = query_new;
  SingleQueryType.tp_call = query_call;
  SingleQueryType.tp_dealloc = dealloc<query_clear>;
  SingleQueryType.tp_traverse = query_traverse;
  SingleQueryType.tp_clear = query_clear;
  SingleQueryType.tp_methods = query_methods;
  ProgramType.tp_basicsize = sizeof(Program);
  ProgramType.tp_flags = Py_TPFLAGS_DEFAULT;
  ProgramType.tp_doc = "Program(package_path, runners=1)(inputs): an AOTInductor package's program, GIL released";
  ProgramType.tp_new = program_new;
  ProgramType.tp_call = program_call;
  ProgramType.tp_dealloc = program_dealloc;
  if (PyType_Ready(&SnapshotType) < 0 || PyType_Ready(&SingleQueryType) < 0 || PyType_Ready(&ProgramType) < 0)
    return nullptr;
#if PY_VERSION_HEX < 0x030E0000
  versions = versions_change();
#endif
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddObject(m, "versions", PyBool_FromLong(versions)) < 0) return nullptr;
  for (PyTypeObject* type : {&SnapshotType, &SingleQueryType, &ProgramType}) {
    Py_INCREF(type);
    if (PyModule_AddObject(m, type->tp_name + std::strlen("quick_call."), reinterpret_cast<PyObject*>(type)) < 0)
      return nullptr;
  }
  return m;
}
