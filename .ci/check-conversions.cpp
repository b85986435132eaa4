// Runs the kernels' 16-bit conversions (kernels/common.cuh, compiled for the host by
// .ci/check-kernels) against references: the compiler's IEEE `_Float16` for f16, and for bf16 a
// rounding written independently (the two neighbouring bf16 values compared in double).
#include <stdio.h>

static unsigned int bits_of(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static float float_of(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }

static unsigned short f16_reference(float f) {
    _Float16 h = (_Float16)f;
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}

static unsigned short bf16_reference(float f) {
    unsigned int x = bits_of(f);
    if (f != f) return 0; // NaN: checked separately
    unsigned int down = x & 0xffff0000u;
    unsigned int up = down + 0x10000u; // the next bf16 away from zero (may be inf)
    double d = (double)f, lo = (double)float_of(down), hi = (double)float_of(up);
    if ((up & 0x7f800000u) == 0x7f800000u) hi = (f < 0 ? -1 : 1) * ldexp(1.0, 128); // IEEE: inf as 2^128
    double below = d - lo < 0 ? lo - d : d - lo, above = hi - d < 0 ? d - hi : hi - d;
    if ((down & 0x7f800000u) == 0x7f800000u) return (unsigned short)(down >> 16); // inf stays inf
    if (below < above) return (unsigned short)(down >> 16);
    if (above < below) return (unsigned short)(up >> 16);
    return (unsigned short)(((down >> 16) & 1u) ? (up >> 16) : (down >> 16)); // tie: even
}

static int failures = 0;

static void check(const char* what, unsigned int input, unsigned int got, unsigned int want) {
    if (got != want && failures++ < 10) {
        printf("%s of 0x%08x: got 0x%04x, want 0x%04x\n", what, input, got, want);
    }
}

int main() {
    // Every 16-bit value widens exactly and rounds back to itself (NaN to a NaN).
    for (unsigned int h = 0; h < 0x10000u; ++h) {
        _Float16 ref;
        unsigned short hs = (unsigned short)h;
        memcpy(&ref, &hs, 2);
        float wide = f16_to_float(hs);
        bool nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
        if (nan) {
            check("f16 NaN widening", h, wide != wide, 1);
            check("f16 NaN rounding", h, (f16_from_float(wide) & 0x7fffu) > 0x7c00u, 1);
        } else {
            check("f16 widening", h, bits_of(wide), bits_of((float)ref));
            check("f16 round trip", h, f16_from_float(wide), hs);
        }
        float bwide = bf16_to_float(hs);
        if (bwide == bwide) {
            check("bf16 round trip", h, bf16_from_float(bwide), hs);
        } else {
            check("bf16 NaN rounding", h, (bf16_from_float(bwide) & 0x7fffu) > 0x7f80u, 1);
        }
    }
    // A sweep of floats: every 97th bit pattern (all exponents, both signs, ties included below).
    unsigned long long count = 0;
    for (unsigned long long x = 0; x < 0x100000000ull; x += 97) {
        float f = float_of((unsigned int)x);
        ++count;
        if (f != f) continue;
        check("f16 rounding", (unsigned int)x, f16_from_float(f), f16_reference(f));
        check("bf16 rounding", (unsigned int)x, bf16_from_float(f), bf16_reference(f));
    }
    // Exact ties between neighbouring 16-bit values round to even.
    for (unsigned int h = 0; h < 0x7c00u; ++h) {
        _Float16 a, b;
        unsigned short ha = (unsigned short)h, hb = (unsigned short)(h + 1);
        memcpy(&a, &ha, 2);
        memcpy(&b, &hb, 2);
        float tie = (float)(((double)(float)a + (double)(float)b) / 2);
        check("f16 tie", bits_of(tie), f16_from_float(tie), f16_reference(tie));
        float btie = float_of((h << 16) | 0x8000u);
        check("bf16 tie", bits_of(btie), bf16_from_float(btie), bf16_reference(btie));
    }
    if (failures) {
        printf("kernels: %d 16-bit conversions differ from the reference\n", failures);
        return 1;
    }
    printf("kernels: 16-bit conversions agree with the references (all 65536 values each way, %llu floats, every tie)\n", count);
    return 0;
}
