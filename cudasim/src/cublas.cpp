// The cuBLAS calls ndscope makes, as plain loops on the CPU over simulated device memory: strided
// batched products in f32 and f64 (sgemm/dgemm), and GemmEx with f32, bf16 or f16 elements and f32
// accumulation. TF32 (CUBLAS_COMPUTE_32F_FAST_TF32) rounds each operand to TF32's 10-bit mantissa
// (to nearest, ties away from zero, as cvt.rna.tf32.f32 does) and accumulates in f32; the order of
// the additions is the simple one, not a GPU's. Every operand range is checked like a kernel's
// accesses (inside its allocation; inputs written before).
#include <string.h>

#include "sim.h"

using namespace sim;

namespace {

enum { STATUS_SUCCESS = 0, STATUS_NOT_INITIALIZED = 1, STATUS_INVALID_VALUE = 7, STATUS_EXECUTION_FAILED = 13,
       STATUS_NOT_SUPPORTED = 15 };
enum { R_32F = 0, R_64F = 1, R_16F = 2, R_16BF = 14 };

struct Handle {
    Stream* stream = nullptr;
};

Stream* stream_of(void* s) { return (uintptr_t)s <= 2 ? nullptr : (Stream*)s; }

float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
uint16_t bf16_from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

size_t elem_size(int type) { return type == R_64F ? 8 : type == R_32F ? 4 : 2; }

double load(const unsigned char* p, int type) {
    switch (type) {
    case R_64F: { double v; memcpy(&v, p, 8); return v; }
    case R_32F: { float v; memcpy(&v, p, 4); return v; }
    case R_16F: { _Float16 v; memcpy(&v, p, 2); return (double)(float)v; }
    default: { uint16_t v; memcpy(&v, p, 2); return bf16_to_float(v); }
    }
}

void store(unsigned char* p, int type, double v) {
    switch (type) {
    case R_64F: memcpy(p, &v, 8); break;
    case R_32F: { float f = (float)v; memcpy(p, &f, 4); break; }
    case R_16F: { _Float16 h = (_Float16)(float)v; memcpy(p, &h, 2); break; }
    default: { uint16_t h = bf16_from_float((float)v); memcpy(p, &h, 2); break; }
    }
}

struct Gemm {
    int ta, tb, m, n, k;
    double alpha, beta;
    uint64_t a, b, c;
    int type_a, type_b, type_c;
    long long lda, ldb, ldc, sa, sb, sc;
    int batches;
    bool wide;  // accumulate in double (dgemm), else in float
    bool tf32;  // round f32 operands to TF32 first
};

float to_tf32(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7f800000u) != 0x7f800000u) x = (x + 0x1000u) & 0xffffe000u;  // inf and NaN stay
    memcpy(&f, &x, 4);
    return f;
}

// Checks the columns of a column-major `rows x cols` matrix with leading dimension ld.
Result check_matrix(uint64_t base, long long rows, long long cols, long long ld, int type, Access access,
                    const char* which) {
    size_t es = elem_size(type);
    for (long long j = 0; j < cols; ++j) {
        Result r = check_range(base + (uint64_t)(j * ld) * es, (size_t)rows * es, access,
                               std::string("cudasim: cuBLAS gemm, operand ") + which + " column " + std::to_string(j));
        if (r != SUCCESS) return r;
    }
    return SUCCESS;
}

// C = alpha op(A) op(B) + beta C, column-major, for every batch.
Result run_gemm(const Gemm& g) {
    size_t ea = elem_size(g.type_a), eb = elem_size(g.type_b), ec = elem_size(g.type_c);
    std::vector<double> pack_a, pack_b;
    for (int batch = 0; batch < g.batches; ++batch) {
        uint64_t a = g.a + (uint64_t)(batch * g.sa) * ea, b = g.b + (uint64_t)(batch * g.sb) * eb,
                 c = g.c + (uint64_t)(batch * g.sc) * ec;
        // op(A) is m x k: A is m x k (N) or k x m (T); op(B) is k x n: B is k x n (N) or n x k (T).
        Result r = check_matrix(a, g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda, g.type_a, Access::Read, "A");
        if (r == SUCCESS) r = check_matrix(b, g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb, g.type_b, Access::Read, "B");
        if (r == SUCCESS && g.beta != 0.0) r = check_matrix(c, g.m, g.n, g.ldc, g.type_c, Access::Read, "C");
        if (r == SUCCESS) r = check_matrix(c, g.m, g.n, g.ldc, g.type_c, Access::Write, "C");
        if (r != SUCCESS) return r;
        // Pack op(A) as m rows of k and op(B) as n columns of k, in the accumulation type, so each
        // output is a dot product of two contiguous rows.
        const unsigned char *pa = (const unsigned char*)a, *pb = (const unsigned char*)b;
        unsigned char* pc = (unsigned char*)c;
        pack_a.resize((size_t)g.m * g.k);
        pack_b.resize((size_t)g.n * g.k);
        for (int i = 0; i < g.m; ++i) {
            for (int l = 0; l < g.k; ++l) {
                double v = load(pa + (size_t)(g.ta ? i * g.lda + l : l * g.lda + i) * ea, g.type_a);
                pack_a[(size_t)i * g.k + l] = g.tf32 ? to_tf32((float)v) : v;
            }
        }
        for (int j = 0; j < g.n; ++j) {
            for (int l = 0; l < g.k; ++l) {
                double v = load(pb + (size_t)(g.tb ? l * g.ldb + j : j * g.ldb + l) * eb, g.type_b);
                pack_b[(size_t)j * g.k + l] = g.tf32 ? to_tf32((float)v) : v;
            }
        }
        for (int j = 0; j < g.n; ++j) {
            const double* bj = &pack_b[(size_t)j * g.k];
            for (int i = 0; i < g.m; ++i) {
                const double* ai = &pack_a[(size_t)i * g.k];
                double v;
                if (g.wide) {
                    double s = 0.0;
                    for (int l = 0; l < g.k; ++l) s += ai[l] * bj[l];
                    v = g.alpha * s;
                } else {
                    float s = 0.0f;
                    for (int l = 0; l < g.k; ++l) s += (float)ai[l] * (float)bj[l];
                    v = (float)(g.alpha * s);
                }
                unsigned char* at = pc + (size_t)(j * g.ldc + i) * ec;
                if (g.beta != 0.0) v += g.beta * load(at, g.type_c);
                if (!g.wide) v = (float)v;
                store(at, g.type_c, v);
            }
        }
    }
    return SUCCESS;
}

int enqueue(void* handle, const Gemm& g) {
    if (!handle) return STATUS_NOT_INITIALIZED;
    if (g.m < 0 || g.n < 0 || g.k < 0 || g.batches < 0 || g.ta > 1 || g.tb > 1 || g.ldc < (g.m > 1 ? g.m : 1)) {
        fail_detail("cudasim: cuBLAS gemm with invalid dimensions");
        return STATUS_INVALID_VALUE;
    }
    if (g.m == 0 || g.n == 0 || g.batches == 0) return STATUS_SUCCESS;
    Result r = submit(((Handle*)handle)->stream, [g]() { return run_gemm(g); });
    return r == SUCCESS ? STATUS_SUCCESS : STATUS_EXECUTION_FAILED;
}

}  // namespace

extern "C" {

int cublasCreate_v2(void** handle) {
    *handle = new Handle;
    return STATUS_SUCCESS;
}
int cublasDestroy_v2(void* handle) {
    delete (Handle*)handle;
    return STATUS_SUCCESS;
}
int cublasSetStream_v2(void* handle, void* stream) {
    ((Handle*)handle)->stream = stream_of(stream);
    return STATUS_SUCCESS;
}
int cublasGetStream_v2(void* handle, void** stream) {
    *stream = ((Handle*)handle)->stream;
    return STATUS_SUCCESS;
}
// The workspace must be device memory; nothing else is done with it here.
int cublasSetWorkspace_v2(void*, void* workspace, size_t bytes) {
    if (bytes && !in_heap((uint64_t)workspace)) {
        fail_detail("cudasim: cublasSetWorkspace with memory that is not device memory");
        return STATUS_INVALID_VALUE;
    }
    return STATUS_SUCCESS;
}
int cublasSetMathMode(void*, int) { return STATUS_SUCCESS; }
int cublasGetMathMode(void*, int* mode) {
    *mode = 0;
    return STATUS_SUCCESS;
}
int cublasGetVersion_v2(void*, int* v) {
    *v = 120800;
    return STATUS_SUCCESS;
}
const char* cublasGetStatusString(int status) {
    switch (status) {
    case STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

int cublasSgemmStridedBatched(void* h, int ta, int tb, int m, int n, int k, const float* alpha, const float* a,
                              int lda, long long sa, const float* b, int ldb, long long sb, const float* beta, float* c,
                              int ldc, long long sc, int batches) {
    return enqueue(h, Gemm{ta, tb, m, n, k, *alpha, *beta, (uint64_t)a, (uint64_t)b, (uint64_t)c, R_32F, R_32F, R_32F,
                           lda, ldb, ldc, sa, sb, sc, batches, false, false});
}
int cublasDgemmStridedBatched(void* h, int ta, int tb, int m, int n, int k, const double* alpha, const double* a,
                              int lda, long long sa, const double* b, int ldb, long long sb, const double* beta,
                              double* c, int ldc, long long sc, int batches) {
    return enqueue(h, Gemm{ta, tb, m, n, k, *alpha, *beta, (uint64_t)a, (uint64_t)b, (uint64_t)c, R_64F, R_64F, R_64F,
                           lda, ldb, ldc, sa, sb, sc, batches, true, false});
}
int cublasSgemm_v2(void* h, int ta, int tb, int m, int n, int k, const float* alpha, const float* a, int lda,
                   const float* b, int ldb, const float* beta, float* c, int ldc) {
    return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}
int cublasDgemm_v2(void* h, int ta, int tb, int m, int n, int k, const double* alpha, const double* a, int lda,
                   const double* b, int ldb, const double* beta, double* c, int ldc) {
    return cublasDgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

// Compute types: 68 CUBLAS_COMPUTE_32F, 77 CUBLAS_COMPUTE_32F_FAST_TF32, 70 64F; 74-76 (the other
// FAST_ 32F modes) compute as 68.
int cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* a,
                               int type_a, int lda, long long sa, const void* b, int type_b, int ldb, long long sb,
                               const void* beta, void* c, int type_c, int ldc, long long sc, int batches, int compute,
                               int) {
    bool wide = compute == 70;
    if (!wide && compute != 68 && compute != 77 && compute != 74 && compute != 75 && compute != 76) {
        fail_detail("cudasim: cublasGemmEx with compute type " + std::to_string(compute) + " (not simulated)");
        return STATUS_NOT_SUPPORTED;
    }
    for (int t : {type_a, type_b, type_c}) {
        if (t != R_32F && t != R_64F && t != R_16F && t != R_16BF) {
            fail_detail("cudasim: cublasGemmEx with data type " + std::to_string(t) + " (not simulated)");
            return STATUS_NOT_SUPPORTED;
        }
    }
    double al = wide ? *(const double*)alpha : *(const float*)alpha;
    double be = wide ? *(const double*)beta : *(const float*)beta;
    return enqueue(h, Gemm{ta, tb, m, n, k, al, be, (uint64_t)a, (uint64_t)b, (uint64_t)c, type_a, type_b, type_c, lda,
                           ldb, ldc, sa, sb, sc, batches, wide, compute == 77});
}
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int type_a, int lda,
                 const void* b, int type_b, int ldb, const void* beta, void* c, int type_c, int ldc, int compute,
                 int algo) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a, type_a, lda, 0, b, type_b, ldb, 0, beta, c, type_c,
                                      ldc, 0, 1, compute, algo);
}

}  // extern "C"
