// What libtorch_cuda registers when a CUDA build of torch is imported on a machine without a GPU (or with none
// visible), for tests on a CPU-only build (tests/test_vram_estimate.py): CUDA hooks at the registry's default
// priority that know no device (the autograd engine's hasPrimaryContext check fails as the real one does), and a
// CUDA device guard that counts no device.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>

namespace {
using namespace c10;
[[noreturn]] void no_device() { TORCH_CHECK(false, "no CUDA device (libtorch_cuda stand-in)"); }

struct NoDeviceGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { no_device(); }
  Device getDevice() const override { no_device(); }
  void setDevice(Device) const override { no_device(); }
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const noexcept override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const noexcept override { return s; }
  DeviceIndex deviceCount() const noexcept override { return 0; }
};
NoDeviceGuard guard;
struct StoreGuard {
  StoreGuard() { c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].store(&guard); }
} store_guard;

struct NoDeviceHooks final : public at::CUDAHooksInterface {
  NoDeviceHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(DeviceIndex index) const override {
    TORCH_CHECK(false, "hasPrimaryContext expects a valid device index, but got device_index=", index);
  }
  DeviceIndex deviceCount() const override { return 0; }
};
struct RegisterHooks {
  RegisterHooks() {
    at::CUDAHooksRegistry()->Register("CUDAHooks",
        [](at::CUDAHooksArgs a) -> std::unique_ptr<at::CUDAHooksInterface> { return std::make_unique<NoDeviceHooks>(a); });
  }
} register_hooks;
} // namespace
