// The Python module ringzero_torch._C: the factory torch.distributed calls for a "ringzero"
// process group.
#include <pybind11/chrono.h>
#include <torch/extension.h>

#include <chrono>
#include <string>

#include "backend.hpp"

namespace {

c10::intrusive_ptr<c10d::Backend> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                         int size, std::chrono::milliseconds timeout,
                                         bool reproducible, const std::string& algorithm) {
  ringzero_torch::backend_options o;
  o.timeout = timeout;
  o.reproducible = reproducible;
  o.algorithm = algorithm;
  return c10::make_intrusive<ringzero_torch::backend>(store, rank, size, o);
}

std::string transport_of(const c10::intrusive_ptr<c10d::Backend>& b) {
  const auto* r = dynamic_cast<const ringzero_torch::backend*>(b.get());
  TORCH_CHECK(r != nullptr, "not a ringzero backend");
  return r->transport_name();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ringzero's c10d backend";
  // The Backend and Store types the signatures below name are torch's Python classes.
  pybind11::module_::import("torch.distributed");
  m.def("create_backend", &create, pybind11::arg("store"), pybind11::arg("rank"),
        pybind11::arg("size"), pybind11::arg("timeout"), pybind11::arg("reproducible") = false,
        pybind11::arg("algorithm") = "", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("transport", &transport_of, pybind11::arg("backend"));
}
