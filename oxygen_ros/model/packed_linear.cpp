// The packed linear of model/packed.py as a C++ kernel: oxygen_packed_native::linear.
//
// A compiled graph (inductor's cpp_wrapper) calls it straight through the dispatcher: no
// Python frame, no GIL per call (the Python kernel of oxygen_packed::linear costs ~10-20 us
// of a decode step's ~30-80 us GEMV, and takes the GIL a fleet's row threads share).
// Same contract as the Python registry: a packed copy is used only while the plain weight
// it was packed from is alive, at the same address, with the same shape, strides and dtype,
// and unwritten since (its version counter); anything else runs at::linear on the plain
// weight, counted. packed_native.py builds this file at configure; nothing else includes it.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

std::optional<int64_t> version_of(const at::Tensor& weight) {
  if (weight.is_inference()) {  // an inference-mode tensor has no version counter
    return std::nullopt;
  }
  return static_cast<int64_t>(weight._version());
}

struct Entry {
  WeakImpl weight;  // the plain weight the copy was packed from (not kept alive)
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype;
  std::optional<int64_t> version;
  at::Tensor packed;  // oneDNN-blocked copy

  bool matches(const at::Tensor& weight) const {
    auto original = this->weight.lock();  // null once the weight is gone
    return original && original->data() == weight.data_ptr() &&
           weight.sizes().vec() == sizes && weight.strides().vec() == strides &&
           weight.scalar_type() == dtype && version_of(weight) == version;
  }
};

std::mutex registry_lock;
std::unordered_map<int64_t, Entry> registry;  // key: the plain weight's data pointer
std::atomic<int64_t> stale_count{0};

int64_t key_of(const at::Tensor& weight) {
  return static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(weight.data_ptr()));
}

at::Tensor lookup(const at::Tensor& weight) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(key_of(weight));
  if (found == registry.end() || !found->second.matches(weight)) {
    return at::Tensor();
  }
  return found->second.packed;
}

// rows [M, K] @ packed^T through oneDNN (the op ATen registers as mkldnn::_linear_pointwise)
at::Tensor packed_matmul(const at::Tensor& rows, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{rows, packed, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  at::Tensor packed = lookup(weight);
  if (!packed.defined()) {
    if (stale_count.fetch_add(1) == 0) {
      TORCH_WARN("a packed linear ran unpacked: its weight ", weight.sizes(),
                 " changed (or was never packed) after configure; results stay exact, "
                 "only slower");
    }
    return at::linear(x, weight);
  }
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return packed_matmul(x.reshape({-1, x.size(-1)}), packed).view(shape);
}

int64_t remember(const at::Tensor& weight, const at::Tensor& packed) {
  Entry entry{WeakImpl(weight.getIntrusivePtr()), weight.sizes().vec(), weight.strides().vec(),
              weight.scalar_type(), version_of(weight), packed};
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.insert_or_assign(key_of(weight), std::move(entry));
  return key_of(weight);
}

void forget(int64_t key) {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.erase(key);
}

int64_t stale_calls() { return stale_count.load(); }

int64_t entries() {
  std::lock_guard<std::mutex> guard(registry_lock);
  return static_cast<int64_t>(registry.size());
}

}  // namespace

// linear has a CPU kernel (its fake, for tracing, is registered from Python); the
// bookkeeping ops take any inputs (a packed copy is an mkldnn tensor).
TORCH_LIBRARY(oxygen_packed_native, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def("remember(Tensor weight, Tensor packed) -> int", remember);
  m.def("forget(int key) -> ()", forget);
  m.def("stale_calls() -> int", stale_calls);
  m.def("entries() -> int", entries);
}

TORCH_LIBRARY_IMPL(oxygen_packed_native, CPU, m) { m.impl("linear", linear); }
