// Indexing: gather along an axis (index_select is a gather whose index is broadcast). The index
// geometry's shape is the output's shape; ndscope checks every index against the axis first.

#define GATHER(T, S)                                                                               \
    extern "C" __global__ void gather_##S(i64 n, T* out, const T* src, Geo gs, const i64* index,   \
                                          Geo gi, int axis) {                                      \
        GRID_STRIDE(i, n) {                                                                        \
            i64 rest = i;                                                                          \
            i64 at_src = gs.offset;                                                                \
            i64 at_index = gi.offset;                                                              \
            for (int d = gi.rank - 1; d >= 0; --d) {                                               \
                i64 c = rest % gi.shape[d];                                                        \
                rest /= gi.shape[d];                                                               \
                at_index += c * gi.stride[d];                                                      \
                if (d != axis) at_src += c * gs.stride[d];                                         \
            }                                                                                      \
            out[i] = src[at_src + index[at_index] * gs.stride[axis]];                              \
        }                                                                                          \
    }

GATHER(float, f32)
GATHER(double, f64)
GATHER(i64, i64)
