// Counter-based random numbers (src/rng.rs states the function): element i of a draw is the
// Philox4x32-10 block of counter offset + i under the key seed, so the GPU and the host give the
// same numbers, and every element is computed on its own.

#define RANDOM_UNIFORM 0
#define RANDOM_NORMAL 1

__device__ __forceinline__ void philox4x32_10(unsigned int c[4], unsigned int k0, unsigned int k1) {
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned long long p0 = (unsigned long long)0xD2511F53u * c[0];
        unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c[2];
        unsigned int next[4] = {(unsigned int)(p1 >> 32) ^ c[1] ^ k0, (unsigned int)p1,
                                (unsigned int)(p0 >> 32) ^ c[3] ^ k1, (unsigned int)p0};
        c[0] = next[0];
        c[1] = next[1];
        c[2] = next[2];
        c[3] = next[3];
    }
}

// Computed in double on every device, as the host does, then rounded to the output type (a 16-bit
// one through float, as the host converts).
__device__ __forceinline__ double random_sample(int dist, unsigned long long seed,
                                                unsigned long long index) {
    unsigned int c[4] = {(unsigned int)index, (unsigned int)(index >> 32), 0u, 0u};
    philox4x32_10(c, (unsigned int)seed, (unsigned int)(seed >> 32));
    const double scale = 1.0 / 16777216.0; // 2^-24
    if (dist == RANDOM_UNIFORM) return (double)(c[0] >> 8) * scale;
    double u1 = (double)((c[0] >> 8) + 1u) * scale;
    double u2 = (double)(c[1] >> 8) * scale;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#define RANDOM(T, C, S)                                                                            \
    extern "C" __global__ void random_##S(i64 n, T* out, int dist, unsigned long long seed,        \
                                          unsigned long long offset) {                             \
        GRID_STRIDE(i, n) { put(&out[i], (C)random_sample(dist, seed, offset + (unsigned long long)i)); } \
    }

RANDOM(float, float, f32)
RANDOM(double, double, f64)
RANDOM(bf16, float, bf16)
RANDOM(f16, float, f16)
