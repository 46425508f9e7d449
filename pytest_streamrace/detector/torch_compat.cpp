// What differs between the torch releases the native parts build against (2.4 to 2.14), in this one place: joined
// after the happens-before core (whose pybind11 brings Python.h first) into the capture's sources (capture.py), so
// that no other source tests a version.
#include <torch/version.h>  // TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR
#define STREAMRACE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#if !STREAMRACE_TORCH_AT_LEAST(2, 5)
#include <torch/csrc/utils/tensor_dtypes.h>  // torch::utils::getDtypeNames
#endif
#include <dlfcn.h>
#include <stdexcept>
#include <string>

namespace torch_compat {

// The torch this was compiled against (the build folder is per torch installation).
constexpr int torch_major = TORCH_VERSION_MAJOR;
constexpr int torch_minor = TORCH_VERSION_MINOR;

// A dtype's Python name ("float", "long", ...): c10's since 2.5 (a string_view in later releases), torch_python's
// before.
#if STREAMRACE_TORCH_AT_LEAST(2, 5)
inline std::string dtype_name(c10::ScalarType dtype) { return std::string(c10::getDtypeNames(dtype).first); }
#else
inline std::string dtype_name(c10::ScalarType dtype) { return torch::utils::getDtypeNames(dtype).first; }
#endif

#if STREAMRACE_TORCH_AT_LEAST(2, 11)
// A GPU stream's native handle (its cudaStream_t: the number torch.cuda.Stream.cuda_stream gives, which records key
// streams by). torch 2.11 gives it for any backend.
inline void ready_for_gpu_streams() {}
inline void* stream_handle(const c10::Stream& stream) { return stream.native_handle(); }
#else
// Before 2.11 only c10::cuda::CUDAStream::stream() gives it, in libc10_cuda (libc10_hip on ROCm), whose header needs
// CUDA's: it is called through its symbol, on the c10::Stream a CUDAStream wraps (its only member, so the same
// object). The library is loaded wherever torch runs on a GPU; found once, when the capture starts on one.
using StreamGetter = void* (*)(const c10::Stream*);
inline StreamGetter stream_getter = nullptr;

inline void ready_for_gpu_streams() {
  if (stream_getter != nullptr) return;
  const char* places[][2] = {{"libc10_cuda.so", "_ZNK3c104cuda10CUDAStream6streamEv"},
                             {"libc10_hip.so", "_ZNK3c103hip9HIPStream6streamEv"}};
  for (auto& [library, symbol] : places) {
    void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    void* found = handle == nullptr ? nullptr : dlsym(handle, symbol);
    if (found != nullptr) {
      stream_getter = reinterpret_cast<StreamGetter>(found);
      return;
    }
  }
  throw std::runtime_error("streamrace: on torch " + std::to_string(torch_major) + "." + std::to_string(torch_minor) +
                           " the C++ op capture finds GPU streams through libc10_cuda, which this process has not "
                           "loaded (torch 2.11 or later needs no library)");
}

inline void* stream_handle(const c10::Stream& stream) { return stream_getter(&stream); }
#endif

}  // namespace torch_compat
