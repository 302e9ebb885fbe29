// The process group DDP's reducer is built over for CPU gradients (see torchpass/ddp.py and native.py).
//
// Each all-reduce goes to the process group it is armed with (the current generation's default group) and
// never fails: when the collective cannot start or completes with an error, the tensors come back as they are,
// the group disarms itself and `on_error(message)` is called once, with the GIL, so that TorchPass abandons
// the step instead of raising in `loss.backward()`. The path without a failure runs no Python at all: a
// Python group (the fallback, torchpass.ddp._CurrentGroup) costs a Python call and a Python callback on
// gloo's thread per bucket, about 1 ms a step on a 2-core machine.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

class GuardedGroup : public c10d::ProcessGroup {
 public:
  GuardedGroup(int size, py::object on_error) : c10d::ProcessGroup(0, size), on_error_(std::move(on_error)) {}

  ~GuardedGroup() override {
    if (!Py_IsInitialized()) {  // the interpreter is gone (exit): nothing left to release the callback to
      on_error_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    on_error_ = py::object();
  }

  // Route the next collectives to `target` (the current generation's group). Held weakly: when TorchPass
  // destroys a generation's group, its sockets must close at once (peers still in a collective with this rank
  // fail then, not at their timeout), so this group must not keep it alive.
  void arm(const c10::intrusive_ptr<c10d::ProcessGroup>& target) {
    std::lock_guard<std::mutex> lock(mu_);
    target_ = c10::weak_intrusive_ptr<c10d::ProcessGroup>(target);
    armed_ = true;
  }

  // Run no collective until armed again (the step is abandoned or the generation is stale).
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
    target_ = kNoGroup();
  }

  bool armed() {
    std::lock_guard<std::mutex> lock(mu_);
    return armed_;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    c10::intrusive_ptr<c10d::ProcessGroup> target;
    bool armed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      armed = armed_;
      if (armed) target = target_.lock();
    }
    std::vector<at::Tensor> result = tensors;
    if (!target) {
      if (armed) fail("the process group of this generation is gone");
      return completed(result);
    }
    // A complex tensor goes as its real view, as dist.all_reduce sends it.
    std::vector<at::Tensor> flat;
    flat.reserve(tensors.size());
    for (const auto& t : tensors) flat.push_back(t.is_complex() ? at::view_as_real(t) : t);
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = target->allreduce(flat, opts);
    } catch (const std::exception& exc) {
      fail(exc.what());
      return completed(result);
    }
    // The callback keeps the group alive until the collective is done.
    auto self = c10::intrusive_ptr<GuardedGroup>::unsafe_reclaim_from_nonowning(this);
    auto done = work->getFuture()->then(
        [self, result](c10::ivalue::Future& future) -> c10::IValue {
          if (future.hasError()) self->fail(future.tryRetrieveErrorMessage());
          return c10::IValue(result);
        },
        c10::ListType::create(c10::TensorType::get()));
    return c10d::Work::create_from_future(done);
  }

 private:
  static c10::intrusive_ptr<c10d::Work> completed(const std::vector<at::Tensor>& tensors) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(tensors));
    return c10d::Work::create_from_future(future);
  }

  void fail(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      bool first = armed_;
      armed_ = false;
      target_ = kNoGroup();
      if (!first) return;
    }
    py::gil_scoped_acquire gil;
    try {
      if (on_error_) on_error_(message);
    } catch (py::error_already_set& exc) {
      exc.discard_as_unraisable("torchpass GuardedGroup on_error");
    }
  }

  static c10::weak_intrusive_ptr<c10d::ProcessGroup> kNoGroup() {
    return c10::weak_intrusive_ptr<c10d::ProcessGroup>(c10::intrusive_ptr<c10d::ProcessGroup>());
  }

  std::mutex mu_;
  bool armed_ = false;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> target_ = kNoGroup();
  py::object on_error_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TorchPass's failure-tolerant process group for DDP's reducer (see torchpass/native.py)";
  py::class_<GuardedGroup, c10d::ProcessGroup, c10::intrusive_ptr<GuardedGroup>>(m, "GuardedGroup")
      .def(py::init<int, py::object>(), py::arg("size"), py::arg("on_error"))
      .def("arm", &GuardedGroup::arm, py::arg("target"), py::call_guard<py::gil_scoped_release>())
      .def("disarm", &GuardedGroup::disarm, py::call_guard<py::gil_scoped_release>())
      .def("armed", &GuardedGroup::armed);
}
