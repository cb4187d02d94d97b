// opsmith's ops from C++ on libtorch alone, no Python: load the route B
// library (its static initialisers register the ops with the dispatcher),
// look the op up by name, call it on the CPU and, where there is one, on a
// GPU, and check the result and its backward against ATen's own rms_norm.
//
//   rms_norm_dispatcher path/to/libopsmith_ops.so      (built by CMakeLists.txt)
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <dlfcn.h>

#include <cstdio>
#include <optional>
#include <tuple>

// the C++ signature of the schema rms_norm_fwd(Tensor x, Tensor? weight,
// float? eps, float offset, str casting_mode, ScalarType? out_dtype,
// bool inplace_backward) -> (Tensor, Tensor): typed() checks it
using RmsNormFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, const std::optional<at::Tensor> &,
                                                      std::optional<double>, double, c10::string_view,
                                                      std::optional<at::ScalarType>, bool);

static bool check(const at::Device &device) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow("opsmith::rms_norm_fwd", "").typed<RmsNormFwd>();
    auto opts = torch::TensorOptions().dtype(torch::kFloat64).device(device);
    torch::Tensor x = torch::randn({8, 96}, opts).requires_grad_();
    torch::Tensor w = torch::randn({96}, opts).requires_grad_();
    // through the dispatcher: the Autograd key's kernel, then the CPU or CUDA one
    auto [y, inv_rms] = op.call(x, w, 1e-6, 0.0, "none", std::nullopt, false);
    torch::Tensor ref = at::rms_norm(x, {96}, w, 1e-6);
    const double err = (y - ref).abs().max().item<double>();
    auto grads = torch::autograd::grad({y.sum()}, {x, w});
    auto ref_grads = torch::autograd::grad({ref.sum()}, {x, w});
    const double gerr = std::max((grads[0] - ref_grads[0]).abs().max().item<double>(),
                                 (grads[1] - ref_grads[1]).abs().max().item<double>());
    std::printf("%s: y %s, max |y - at::rms_norm| = %.2e, gradients %.2e, grad_fn %s\n", device.str().c_str(),
                y.device().str().c_str(), err, gerr, y.grad_fn() ? y.grad_fn()->name().c_str() : "none");
    return err < 1e-12 && gerr < 1e-10 && y.device() == device;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s path/to/libopsmith_ops.so\n", argv[0]);
        return 2;
    }
    if (!dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) {
        std::fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
        return 1;
    }
    bool ok = check(at::Device(at::kCPU));
    if (torch::cuda::is_available()) ok = check(at::Device(at::kCUDA, 0)) && ok;
    else std::printf("cuda: no device, skipped\n");
    std::printf(ok ? "cpp example ok\n" : "cpp example FAILED\n");
    return ok ? 0 : 1;
}
