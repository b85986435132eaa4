// Sliding windows over planes of rows x cols elements (src/backend/op.rs, Window2d): unfold2d copies
// each window tap into a column (im2col), fold2d sums the columns back into the planes (col2im).

// The window's geometry; the field order is `WindowArg`'s in src/backend/cuda/ops.rs.
struct Window {
    i64 planes, rows, cols, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
};

// T is the element type, C the type sums are computed in (float for the 16-bit types).
#define WINDOW(T, C, S)                                                                            \
    /* One thread per column element [plane, ki, kj, oy, ox]. */                                   \
    extern "C" __global__ void unfold2d_##S(i64 n, T* out, const T* x, Window w, C pad) {          \
        GRID_STRIDE(i, n) {                                                                        \
            i64 rest = i;                                                                          \
            i64 ox = rest % w.ow; rest /= w.ow;                                                    \
            i64 oy = rest % w.oh; rest /= w.oh;                                                    \
            i64 kj = rest % w.kw; rest /= w.kw;                                                    \
            i64 ki = rest % w.kh;                                                                  \
            i64 p = rest / w.kh;                                                                   \
            i64 iy = oy * w.sh + ki * w.dh - w.ph;                                                 \
            i64 ix = ox * w.sw + kj * w.dw - w.pw;                                                 \
            bool inside = iy >= 0 && iy < w.rows && ix >= 0 && ix < w.cols;                        \
            put(&out[i], inside ? ld(x[(p * w.rows + iy) * w.cols + ix]) : pad);                   \
        }                                                                                          \
    }                                                                                              \
    /* One thread per plane element [plane, y, x]: the sum, in kernel-offset order, of the       */ \
    /* columns whose tap reads it, as the host adds them.                                         */ \
    extern "C" __global__ void fold2d_##S(i64 n, T* out, const T* cols, Window w) {                \
        GRID_STRIDE(i, n) {                                                                        \
            i64 x = i % w.cols;                                                                    \
            i64 y = (i / w.cols) % w.rows;                                                         \
            i64 p = i / (w.cols * w.rows);                                                         \
            C sum = (C)0;                                                                          \
            for (i64 ki = 0; ki < w.kh; ++ki) {                                                    \
                i64 ty = y + w.ph - ki * w.dh;                                                     \
                if (ty < 0 || ty % w.sh != 0 || ty / w.sh >= w.oh) continue;                      \
                for (i64 kj = 0; kj < w.kw; ++kj) {                                                \
                    i64 tx = x + w.pw - kj * w.dw;                                                 \
                    if (tx < 0 || tx % w.sw != 0 || tx / w.sw >= w.ow) continue;                   \
                    sum += ld(cols[(((p * w.kh + ki) * w.kw + kj) * w.oh + ty / w.sh) * w.ow + tx / w.sw]); \
                }                                                                                  \
            }                                                                                      \
            put(&out[i], sum);                                                                     \
        }                                                                                          \
    }

WINDOW(float, float, f32)
WINDOW(double, double, f64)
WINDOW(i64, i64, i64)
WINDOW(bf16, float, bf16)
WINDOW(f16, float, f16)
