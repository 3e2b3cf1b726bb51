// fake_cuda_guard.cpp -- lets PyTorch run autograd over *fake* CUDA tensors (torch._subclasses.FakeTensorMode)
// where no CUDA device is usable: a CPU-only build, or a CUDA build on a machine without a GPU (or with none
// visible). For memory estimation only. Built and loaded by fakecuda.py.
//
// It registers (1) a no-op DeviceGuardImpl for DeviceType::CUDA (devices, streams and events are
// no-ops; one device, index 0) and (2) a CUDAHooks object whose hasCUDA() is true, so that
// at::getAccelerator() reports CUDA and the autograd engine's stream bookkeeping (Node::stream,
// InputBuffer::add) works. No kernel, allocator or memory exists: any real CUDA op still fails.
// torch.cuda.is_available() stays False. It must be loaded (ctypes, RTLD_GLOBAL) *before*
// `import torch`, because ATen creates its CUDA hooks object once, during that import. In a CUDA build,
// libtorch_cuda registers its own hooks when torch is imported: ours are registered at a higher priority, so
// the registry keeps them, and fake_cuda_install_guard() (called after the import) puts the guard back over
// the one libtorch_cuda stored. Never load it into a process that uses a real GPU.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>

namespace {
using namespace c10;
struct FakeCUDAGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream getDefaultStream(Device) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream getNewStream(Device, int) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void** event, const Stream&, const DeviceIndex, const EventFlag) const override {
    static int dummy; if (event) *event = &dummy;
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

struct FakeCUDAHooks final : public at::CUDAHooksInterface {
  FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void deviceSynchronize(DeviceIndex) const override {}
};

FakeCUDAGuardImpl guard_impl;
struct Registrar {
  Registrar() { c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].store(&guard_impl); }
} registrar_instance;
} // namespace

extern "C" void fake_cuda_install_guard() {
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)].store(&guard_impl);
}


namespace { struct HooksAlias { HooksAlias() {
  // getCUDAHooks() looks the registry up under the name "CUDAHooks".
  at::CUDAHooksRegistry()->Register("CUDAHooks",
      [](at::CUDAHooksArgs a) -> std::unique_ptr<at::CUDAHooksInterface> { return std::make_unique<FakeCUDAHooks>(a); },
      c10::REGISTRY_PREFERRED);   // above libtorch_cuda's default-priority registration
} } hooks_alias_instance; }

extern "C" int fake_cuda_hooks_active() { return at::detail::getCUDAHooks().hasCUDA() ? 1 : 0; }
