// dflash_kernels._C: the torch binding of the CUDA conv kernels.
//
// Thin on purpose: check devices and dtypes, fill the C parameter structs from tensor pointers and
// strides, launch on the input's device and that device's current stream. Outputs are allocated
// by the Python launchers (dflash_kernels/ops/conv1d/cuda.py), so the library's output poisoning in
// tests covers these kernels too.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <string>

#include "causal_conv1d/causal_conv1d.h"

#ifndef DFLASH_CSRC_HASH
#define DFLASH_CSRC_HASH "unknown"
#endif

namespace {

using OptTensor = std::optional<at::Tensor>;

int dtype_tag(const at::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return DFLASH_F32;
        case at::kHalf: return DFLASH_F16;
        case at::kBFloat16: return DFLASH_BF16;
        default: TORCH_CHECK(false, name, ": dtype ", t.scalar_type(), " is not supported (float32, float16, bfloat16)");
    }
    return -1;
}

void check_on(const at::Tensor& t, const char* name, const at::Tensor& x) {
    TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got device ", t.device());
    TORCH_CHECK(t.device() == x.device(), name, ": on ", t.device(), " but x is on ", x.device());
}

const at::Tensor* get(const OptTensor& t) { return t.has_value() && t->defined() ? &t.value() : nullptr; }

bool channel_last(const at::Tensor& x) { return x.stride(1) == 1 && x.stride(2) != 1; }

void check_launch(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, "dflash_kernels._C.", what, ": ", cudaGetErrorString(err));
}

DflashConvParams common(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                        const OptTensor& seq_idx, const OptTensor& init, bool silu) {
    TORCH_CHECK(x.dim() == 3, "x: expected [B, D, T], got ", x.sizes());
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x.size(1) && weight.size(1) >= 2 && weight.size(1) <= 4,
                "weight: expected [D=", x.size(1), ", W in 2..4], got ", weight.sizes());
    check_on(x, "x", x);
    check_on(weight, "weight", x);
    DflashConvParams p{};
    p.batch = x.size(0);
    p.dim = x.size(1);
    p.seqlen = x.size(2);
    p.width = int(weight.size(1));
    p.x_dtype = dtype_tag(x, "x");
    p.channel_last = channel_last(x) ? 1 : 0;
    p.silu = silu ? 1 : 0;
    p.x = x.data_ptr();
    p.x_sb = x.stride(0); p.x_sd = x.stride(1); p.x_st = x.stride(2);
    p.weight = weight.data_ptr();
    p.w_sd = weight.stride(0); p.w_sw = weight.stride(1);
    p.weight_dtype = dtype_tag(weight, "weight");
    if (auto* b = get(bias)) {
        check_on(*b, "bias", x);
        TORCH_CHECK(b->dim() == 1 && b->size(0) == p.dim, "bias: expected [D=", p.dim, "], got ", b->sizes());
        p.bias = b->data_ptr(); p.bias_s = b->stride(0); p.bias_dtype = dtype_tag(*b, "bias");
    }
    if (auto* s = get(seq_idx)) {
        check_on(*s, "seq_idx", x);
        TORCH_CHECK(s->scalar_type() == at::kInt, "seq_idx: expected int32, got ", s->scalar_type());
        TORCH_CHECK(s->dim() == 2 && s->size(0) == p.batch && s->size(1) == p.seqlen && s->stride(1) == 1,
                    "seq_idx: expected [B=", p.batch, ", T=", p.seqlen, "] with stride 1 along T, got ", s->sizes(),
                    " strides ", s->strides());
        p.seq_idx = s->data_ptr<int32_t>(); p.seq_sb = s->stride(0);
    }
    if (auto* i = get(init)) {
        check_on(*i, "initial_states", x);
        TORCH_CHECK(i->dim() == 3 && i->size(0) == p.batch && i->size(1) == p.dim && i->size(2) == p.width - 1,
                    "initial_states: expected [B, D, W-1], got ", i->sizes());
        p.init = i->data_ptr(); p.init_dtype = dtype_tag(*i, "initial_states");
        p.init_sb = i->stride(0); p.init_sd = i->stride(1); p.init_st = i->stride(2);
    }
    return p;
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& x) {
    check_on(t, name, x);
    TORCH_CHECK(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type(), name, ": expected shape ", x.sizes(),
                " and dtype ", x.scalar_type(), ", got ", t.sizes(), " ", t.scalar_type());
}

void check_state(const at::Tensor& t, const char* name, const DflashConvParams& p, const at::Tensor& x) {
    check_on(t, name, x);
    TORCH_CHECK(t.dim() == 3 && t.size(0) == p.batch && t.size(1) == p.dim && t.size(2) == p.width - 1,
                name, ": expected [B, D, W-1], got ", t.sizes());
}

void fwd(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& seq_idx,
         const OptTensor& init, const at::Tensor& y, const OptTensor& final_states, bool silu) {
    DflashConvParams p = common(x, weight, bias, seq_idx, init, silu);
    check_like(y, "y", x);
    p.y = y.data_ptr(); p.y_sb = y.stride(0); p.y_sd = y.stride(1); p.y_st = y.stride(2);
    if (auto* f = get(final_states)) {
        check_state(*f, "final_states", p, x);
        p.final_states = f->data_ptr(); p.fin_dtype = dtype_tag(*f, "final_states");
        p.fin_sb = f->stride(0); p.fin_sd = f->stride(1); p.fin_st = f->stride(2);
    }
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(dflash_causal_conv1d_fwd(&p, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), "fwd");
}

int64_t bwd_partials(const at::Tensor& x, const at::Tensor& weight) {
    DflashConvParams p = common(x, weight, std::nullopt, std::nullopt, std::nullopt, false);
    const c10::cuda::CUDAGuard guard(x.device());
    return dflash_causal_conv1d_bwd_partials(&p);
}

void bwd(const at::Tensor& dy, const OptTensor& dfinal, const at::Tensor& x, const at::Tensor& weight,
         const OptTensor& bias, const OptTensor& seq_idx, const OptTensor& init, const at::Tensor& dx,
         const at::Tensor& dweight_part, const OptTensor& dbias_part, const OptTensor& dinit, bool silu) {
    DflashConvParams p = common(x, weight, bias, seq_idx, init, silu);
    check_on(dy, "dy", x);
    TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "dy: expected shape ", x.sizes(),
                " and dtype ", x.scalar_type(), ", got ", dy.sizes(), " ", dy.scalar_type());
    check_like(dx, "dx", x);
    p.dy = dy.data_ptr(); p.dy_sb = dy.stride(0); p.dy_sd = dy.stride(1); p.dy_st = dy.stride(2);
    p.dx = dx.data_ptr(); p.dx_sb = dx.stride(0); p.dx_sd = dx.stride(1); p.dx_st = dx.stride(2);
    if (auto* f = get(dfinal)) {
        check_state(*f, "dfinal_states", p, x);
        p.dfinal = f->data_ptr(); p.dfin_dtype = dtype_tag(*f, "dfinal_states");
        p.dfin_sb = f->stride(0); p.dfin_sd = f->stride(1); p.dfin_st = f->stride(2);
    }
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t parts = dflash_causal_conv1d_bwd_partials(&p);
    check_on(dweight_part, "dweight_part", x);
    TORCH_CHECK(dweight_part.scalar_type() == at::kFloat && dweight_part.is_contiguous() &&
                    dweight_part.sizes() == at::IntArrayRef({parts, p.dim, int64_t(p.width)}),
                "dweight_part: expected contiguous float32 [", parts, ", ", p.dim, ", ", p.width, "], got ",
                dweight_part.sizes());
    p.dweight_part = dweight_part.data_ptr<float>();
    if (p.bias != nullptr) {
        auto* db = get(dbias_part);
        TORCH_CHECK(db != nullptr, "dbias_part: required when bias is given");
        check_on(*db, "dbias_part", x);
        TORCH_CHECK(db->scalar_type() == at::kFloat && db->is_contiguous() &&
                        db->sizes() == at::IntArrayRef({parts, p.dim}),
                    "dbias_part: expected contiguous float32 [", parts, ", ", p.dim, "], got ", db->sizes());
        p.dbias_part = db->data_ptr<float>();
    }
    if (p.init != nullptr) {
        auto* di = get(dinit);
        TORCH_CHECK(di != nullptr, "dinitial_states: required when initial_states is given");
        check_state(*di, "dinitial_states", p, x);
        p.dinit = di->data_ptr(); p.dinit_dtype = dtype_tag(*di, "dinitial_states");
        p.dinit_sb = di->stride(0); p.dinit_sd = di->stride(1); p.dinit_st = di->stride(2);
    }
    check_launch(dflash_causal_conv1d_bwd(&p, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), "bwd");
}

void update(const at::Tensor& x, const at::Tensor& state, const at::Tensor& weight, const OptTensor& bias,
            const at::Tensor& y, bool silu) {
    TORCH_CHECK(x.dim() == 3, "x: expected [B, D, L], got ", x.sizes());
    check_on(x, "x", x);
    check_on(state, "conv_state", x);
    check_on(weight, "weight", x);
    check_like(y, "y", x);
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x.size(1) && weight.size(1) >= 2 && weight.size(1) <= 4,
                "weight: expected [D=", x.size(1), ", W in 2..4], got ", weight.sizes());
    TORCH_CHECK(state.dim() == 3 && state.size(0) == x.size(0) && state.size(1) == x.size(1) &&
                    state.size(2) >= weight.size(1) - 1,
                "conv_state: expected [B, D, S >= W-1], got ", state.sizes());
    DflashConvUpdateParams p{};
    p.batch = x.size(0); p.dim = x.size(1); p.len = x.size(2); p.state_len = state.size(2);
    p.width = int(weight.size(1)); p.silu = silu ? 1 : 0;
    p.x = x.data_ptr(); p.x_dtype = dtype_tag(x, "x");
    p.x_sb = x.stride(0); p.x_sd = x.stride(1); p.x_sl = x.stride(2);
    p.state = state.data_ptr(); p.state_dtype = dtype_tag(state, "conv_state");
    p.s_sb = state.stride(0); p.s_sd = state.stride(1); p.s_ss = state.stride(2);
    p.weight = weight.data_ptr(); p.weight_dtype = dtype_tag(weight, "weight");
    p.w_sd = weight.stride(0); p.w_sw = weight.stride(1);
    if (auto* b = get(bias)) {
        check_on(*b, "bias", x);
        TORCH_CHECK(b->dim() == 1 && b->size(0) == p.dim, "bias: expected [D=", p.dim, "], got ", b->sizes());
        p.bias = b->data_ptr(); p.bias_s = b->stride(0); p.bias_dtype = dtype_tag(*b, "bias");
    }
    p.y = y.data_ptr(); p.y_dtype = dtype_tag(y, "y");
    p.y_sb = y.stride(0); p.y_sd = y.stride(1); p.y_sl = y.stride(2);
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(dflash_causal_conv1d_update(&p, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), "update");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dflash_kernels CUDA kernels (causal depthwise conv1d)";
    m.def("causal_conv1d_fwd", &fwd, "forward; writes y and final_states", py::arg("x"), py::arg("weight"),
          py::arg("bias"), py::arg("seq_idx"), py::arg("initial_states"), py::arg("y"), py::arg("final_states"),
          py::arg("silu"));
    m.def("causal_conv1d_bwd_partials", &bwd_partials, "rows of the backward's partial dweight/dbias buffers",
          py::arg("x"), py::arg("weight"));
    m.def("causal_conv1d_bwd", &bwd, "backward; writes dx, partial dweight/dbias rows and dinitial_states",
          py::arg("dy"), py::arg("dfinal"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("seq_idx"),
          py::arg("initial_states"), py::arg("dx"), py::arg("dweight_part"), py::arg("dbias_part"),
          py::arg("dinit"), py::arg("silu"));
    m.def("causal_conv1d_update", &update, "decode step; updates conv_state in place, writes y", py::arg("x"),
          py::arg("conv_state"), py::arg("weight"), py::arg("bias"), py::arg("y"), py::arg("silu"));
    m.def("source_hash", []() { return std::string(DFLASH_CSRC_HASH); },
          "hash of the CUDA sources this extension was built from");
}
