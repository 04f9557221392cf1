// Native helpers for zerocopy_pickle (see csrc/README.md and zerocopy_pickle/native.py).
//
// Built at run time by torch.utils.cpp_extension (never at pip install time) and loaded only when the
// native backend is active. Every function here has a pure-Python twin giving the same results; native.py
// chooses between them.
//
//   storage_from_buffer(obj) -> torch.UntypedStorage
//       A CPU storage over a writable, C-contiguous buffer, without copying it. The storage owns a
//       Py_buffer export of `obj` for as long as it lives: an exporter such as mmap refuses close() while
//       any storage over it is alive, so memory is never unmapped under a tensor.
//   jit_load_from_buffer(obj, device) -> torch._C.ScriptModule
//       torch.jit.load's import, reading the archive in place from the buffer's memory: no bytes object,
//       no std::string and no std::istringstream copy of the archive.

// Only the headers these helpers use (not <torch/extension.h>, which pulls in the whole C++ frontend and
// doubles the compile time).
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <istream>
#include <memory>
#include <optional>
#include <streambuf>

namespace py = pybind11;

namespace {

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Owns one Py_buffer export; the DataPtr context of a storage built by storage_from_buffer.
struct BufferExport {
  Py_buffer view{};
};

// The storage's deleter. It may run on any thread, with or without the GIL (a tensor freed by a C++ worker
// thread, say), so it takes the GIL itself when it does not hold it. While the interpreter shuts down, only
// a thread that already holds the GIL may touch Python objects (taking the GIL then could hang another
// thread); elsewhere, and after shutdown, the export is leaked: the process is exiting.
void release_export(void* context) {
  auto* owner = static_cast<BufferExport*>(context);
  if (Py_IsInitialized()) {
    if (PyGILState_Check()) {
      PyBuffer_Release(&owner->view);
    } else if (!finalizing()) {
      PyGILState_STATE state = PyGILState_Ensure();
      PyBuffer_Release(&owner->view);
      PyGILState_Release(state);
    }
  }
  delete owner;
}

py::object wrap_storage(c10::Storage storage) {
  PyObject* result = THPStorage_Wrap(std::move(storage));
  if (result == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(result);
}

py::object storage_from_buffer(const py::handle& obj) {
  auto owner = std::make_unique<BufferExport>();
  if (PyObject_GetBuffer(obj.ptr(), &owner->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
    // BufferError for read-only or non-contiguous buffers, TypeError for objects without the protocol.
    throw py::error_already_set();
  }
  const Py_ssize_t nbytes = owner->view.len;
  if (nbytes == 0) {
    // Nothing to alias or protect: the same storage as torch.UntypedStorage(0).
    PyBuffer_Release(&owner->view);
    return wrap_storage(c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), 0, c10::GetCPUAllocator(), /*resizable=*/true)));
  }
  void* data = owner->view.buf;
  // From here the DataPtr owns the export: if anything below throws, its destructor releases it.
  c10::DataPtr data_ptr(data, owner.release(), &release_export, c10::Device(c10::DeviceType::CPU));
  auto impl = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(data_ptr),
      /*allocator=*/nullptr, /*resizable=*/false);
  return wrap_storage(c10::Storage(std::move(impl)));
}

// A read-only std::streambuf over memory the caller keeps alive; seekable, which is all the archive reader
// (caffe2::serialize::IStreamAdapter) needs.
class MemoryStreamBuf final : public std::streambuf {
 public:
  MemoryStreamBuf(const char* data, std::size_t size) {
    char* begin = const_cast<char*>(data);  // never written: this streambuf has no put area
    setg(begin, begin, begin + size);
  }

 protected:
  pos_type seekoff(off_type off, std::ios_base::seekdir dir, std::ios_base::openmode which) override {
    if (!(which & std::ios_base::in)) {
      return pos_type(off_type(-1));
    }
    off_type base = 0;
    if (dir == std::ios_base::cur) {
      base = gptr() - eback();
    } else if (dir == std::ios_base::end) {
      base = egptr() - eback();
    }
    return seekpos(pos_type(base + off), which);
  }

  pos_type seekpos(pos_type pos, std::ios_base::openmode which) override {
    const off_type offset = off_type(pos);
    if (!(which & std::ios_base::in) || offset < 0 || offset > egptr() - eback()) {
      return pos_type(off_type(-1));
    }
    setg(eback(), eback() + offset, egptr());
    return pos;
  }
};

struct BufferGuard {
  Py_buffer view{};
  bool held = false;
  ~BufferGuard() {
    if (held) {
      PyBuffer_Release(&view);
    }
  }
};

torch::jit::Module jit_load_from_buffer(const py::handle& obj, std::optional<c10::Device> device) {
  BufferGuard guard;
  if (PyObject_GetBuffer(obj.ptr(), &guard.view, PyBUF_C_CONTIGUOUS) != 0) {
    throw py::error_already_set();
  }
  guard.held = true;
  // The export is held for the whole import, so the buffer cannot be closed or resized meanwhile. The import
  // copies every record it keeps (tensor data included): nothing in the module points into the buffer.
  MemoryStreamBuf streambuf(static_cast<const char*>(guard.view.buf), static_cast<std::size_t>(guard.view.len));
  std::istream in(&streambuf);
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::ExtraFilesMap extra_files;
  return torch::jit::import_ir_module(
      std::move(cu), in, device, extra_files, /*load_debug_files=*/true, /*restore_shapes=*/false);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zerocopy_pickle native helpers (see zerocopy_pickle/native.py)";
  m.def("storage_from_buffer", &storage_from_buffer, py::arg("buffer"),
        "A CPU UntypedStorage over a writable buffer, holding the buffer's export while it lives.");
  m.def("jit_load_from_buffer", &jit_load_from_buffer, py::arg("buffer"), py::arg("device") = py::none(),
        "Import a TorchScript archive from a buffer without copying it; returns the C++ module.");
}
