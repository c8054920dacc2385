// Peer benchmark: cost of one decoding step's weight GEMMs with ggml's CPU kernels.
//
// Shapes are those of pycode-15m (dim 384, hidden 1024, 8 layers, vocab 2048):
// per layer wq, wk, wv, wo [384x384], w1, w3 [1024x384], w2 [384x1024] ([out][in]),
// plus the classifier [2048x384]. All 57 matrices are multiplied by an f32
// activation matrix of N rows with ggml_mul_mat (weights = src0, activations =
// src1), all in ONE graph, so one graph compute == one step's GEMMs (each mul_mat
// is one parallel region, as in llama.cpp). No attention, norms, rope, sampling.
//
// Weight formats: f32, bf16, q8_0, q4_0 (plain CPU buffer, ggml's vec_dot /
// llamafile sgemm path) and q4_0_repack (Q4_0 placed in the CPU "extra" buffer
// type, i.e. repacked at load to Q4_0_8x8 -- what llama.cpp does by default for
// Q4_0 weights on AVX2/AVX-512 CPUs).
//
// Usage: ggml_step [-t threads=2] [-s seconds_per_case=1.0] [-f fmt,fmt,...]
//                  [-n N,N,...] [-o out.csv]
// Prints a table and a CSV block (format,N,min_us,median_us).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { DIM = 384, HIDDEN = 1024, LAYERS = 8, VOCAB = 2048, PER_LAYER = 7 };
enum { NMAT = LAYERS * PER_LAYER + 1 };

typedef struct { int out, in; } shape_t;

static shape_t mat_shape(int i) {
    if (i == NMAT - 1) return (shape_t){VOCAB, DIM};          // classifier
    switch (i % PER_LAYER) {
        case 0: case 1: case 2: case 3: return (shape_t){DIM, DIM};    // wq wk wv wo
        case 4: case 5:                 return (shape_t){HIDDEN, DIM}; // w1 w3
        default:                        return (shape_t){DIM, HIDDEN}; // w2
    }
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float frand(void) {  // uniform in [-1, 1)
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static int cmp_double(const void * a, const void * b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct { const char * name; enum ggml_type type; int repack; } fmt_t;
static const fmt_t ALL_FMTS[] = {
    {"f32", GGML_TYPE_F32, 0}, {"bf16", GGML_TYPE_BF16, 0}, {"q8_0", GGML_TYPE_Q8_0, 0},
    {"q4_0", GGML_TYPE_Q4_0, 0}, {"q4_0_repack", GGML_TYPE_Q4_0, 1},
};
enum { NFMT_ALL = sizeof(ALL_FMTS) / sizeof(ALL_FMTS[0]) };

static int in_list(const char * list, const char * name) {
    if (!list) return 1;
    size_t n = strlen(name);
    for (const char * p = list; *p;) {
        const char * e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0) return 1;
        if (!e) break;
        p = e + 1;
    }
    return 0;
}

static void log_cb(enum ggml_log_level level, const char * text, void * user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);  // drop per-tensor "repack" debug lines
}

int main(int argc, char ** argv) {
    ggml_log_set(log_cb, NULL);
    int n_threads = 2;
    double secs = 1.0;
    const char * fmt_list = NULL;
    const char * out_csv = NULL;
    int ns[16] = {1, 2, 4, 8, 16, 32, 64}, n_ns = 7;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc) n_threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s") && i + 1 < argc) secs = atof(argv[++i]);
        else if (!strcmp(argv[i], "-f") && i + 1 < argc) fmt_list = argv[++i];
        else if (!strcmp(argv[i], "-o") && i + 1 < argc) out_csv = argv[++i];
        else if (!strcmp(argv[i], "-n") && i + 1 < argc) {
            n_ns = 0;
            for (char * p = argv[++i]; *p && n_ns < 16;) {
                ns[n_ns++] = (int)strtol(p, &p, 10);
                if (*p == ',') p++;
            }
        } else {
            fprintf(stderr, "usage: %s [-t threads] [-s seconds_per_case] [-f fmts] [-n Ns] [-o csv]\n", argv[0]);
            return 2;
        }
    }

    ggml_backend_t backend = ggml_backend_cpu_init();
    if (!backend) { fprintf(stderr, "cpu backend init failed\n"); return 1; }
    ggml_backend_cpu_set_n_threads(backend, n_threads);

    // the CPU backend's extra buffer types (NULL-terminated); find CPU_AARCH64 (repack)
    ggml_backend_buffer_type_t repack_buft = NULL;
    {
        ggml_backend_reg_t reg = ggml_backend_cpu_reg();
        ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
        ggml_backend_dev_get_extra_bufts_t get_extra =
            (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        if (get_extra) {
            for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; b++) {
                if (!strcmp(ggml_backend_buft_name(*b), "CPU_AARCH64")) repack_buft = *b;
            }
        }
    }

    printf("ggml CPU step benchmark: pycode-15m shapes (dim %d, hidden %d, %d layers, vocab %d), %d mul_mats/step, %d threads\n",
           DIM, HIDDEN, LAYERS, VOCAB, NMAT, n_threads);
    printf("cpu features: AVX2=%d AVX512=%d AVX512_VNNI=%d AVX512_BF16=%d AVX_VNNI=%d llamafile=%d openmp=%d repack_buft=%s\n",
           ggml_cpu_has_avx2(), ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni(), ggml_cpu_has_avx512_bf16(),
           ggml_cpu_has_avx_vnni(), ggml_cpu_has_llamafile(), 0
#ifdef _OPENMP
           + 1
#endif
           , repack_buft ? ggml_backend_buft_name(repack_buft) : "none");

    // f32 master weights and the largest activations
    float * w32[NMAT];
    size_t n_params = 0;
    for (int m = 0; m < NMAT; m++) {
        shape_t s = mat_shape(m);
        w32[m] = malloc(sizeof(float) * (size_t)s.out * s.in);
        float scale = 1.0f / sqrtf((float)s.in);
        for (size_t k = 0; k < (size_t)s.out * s.in; k++) w32[m][k] = frand() * scale;
        n_params += (size_t)s.out * s.in;
    }
    int n_max = 1;
    for (int i = 0; i < n_ns; i++) if (ns[i] > n_max) n_max = ns[i];
    float * x_dim = malloc(sizeof(float) * DIM * n_max);
    float * x_hid = malloc(sizeof(float) * HIDDEN * n_max);
    for (int k = 0; k < DIM * n_max; k++) x_dim[k] = frand();
    for (int k = 0; k < HIDDEN * n_max; k++) x_hid[k] = frand();

    FILE * csv = out_csv ? fopen(out_csv, "w") : NULL;
    if (csv) fprintf(csv, "format,N,min_us,median_us\n");

    // results for the table
    double res_min[NFMT_ALL][16], res_med[NFMT_ALL][16];
    int res_ok[NFMT_ALL] = {0};
    size_t res_bytes[NFMT_ALL] = {0};
    double checksum_total = 0.0;

    for (int f = 0; f < NFMT_ALL; f++) {
        const fmt_t * fmt = &ALL_FMTS[f];
        if (!in_list(fmt_list, fmt->name)) continue;
        if (fmt->repack && !repack_buft) { printf("%s: no repack buffer type, skipped\n", fmt->name); continue; }

        // ---- weights: one no_alloc context, allocated in the chosen buffer type ----
        struct ggml_init_params wp = { ggml_tensor_overhead() * (NMAT + 4), NULL, true };
        struct ggml_context * wctx = ggml_init(wp);
        struct ggml_tensor * W[NMAT];
        for (int m = 0; m < NMAT; m++) {
            shape_t s = mat_shape(m);
            W[m] = ggml_new_tensor_2d(wctx, fmt->type, s.in, s.out);  // ne0 = K (in), ne1 = M (out)
        }
        ggml_backend_buffer_type_t buft = fmt->repack ? repack_buft : ggml_backend_cpu_buffer_type();
        ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft);
        ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        size_t bytes = 0;
        for (int m = 0; m < NMAT; m++) {
            shape_t s = mat_shape(m);
            size_t sz = ggml_row_size(fmt->type, s.in) * s.out;
            void * tmp = malloc(sz);
            if (fmt->type == GGML_TYPE_F32) memcpy(tmp, w32[m], sz);
            else {
                size_t q = ggml_quantize_chunk(fmt->type, w32[m], tmp, 0, s.out, s.in, NULL);
                if (q != sz) { fprintf(stderr, "quantize size mismatch %zu vs %zu\n", q, sz); return 1; }
            }
            ggml_backend_tensor_set(W[m], tmp, 0, sz);  // repack happens here for the extra buft
            free(tmp);
            bytes += sz;
        }
        res_bytes[f] = bytes;
        res_ok[f] = 1;

        for (int ni = 0; ni < n_ns; ni++) {
            const int N = ns[ni];
            // ---- activations + outputs + graph ----
            struct ggml_init_params cp = { ggml_tensor_overhead() * (2 * NMAT + 8) + ggml_graph_overhead(), NULL, true };
            struct ggml_context * cctx = ggml_init(cp);
            struct ggml_tensor * a_dim = ggml_new_tensor_2d(cctx, GGML_TYPE_F32, DIM, N);
            struct ggml_tensor * a_hid = ggml_new_tensor_2d(cctx, GGML_TYPE_F32, HIDDEN, N);
            struct ggml_tensor * Y[NMAT];
            struct ggml_cgraph * gf = ggml_new_graph(cctx);
            for (int m = 0; m < NMAT; m++) {
                shape_t s = mat_shape(m);
                Y[m] = ggml_mul_mat(cctx, W[m], s.in == DIM ? a_dim : a_hid);  // [M x N]
                ggml_build_forward_expand(gf, Y[m]);
            }
            ggml_backend_buffer_t cbuf = ggml_backend_alloc_ctx_tensors(cctx, backend);
            ggml_backend_tensor_set(a_dim, x_dim, 0, sizeof(float) * DIM * N);
            ggml_backend_tensor_set(a_hid, x_hid, 0, sizeof(float) * HIDDEN * N);

            // ---- warm-up, then timed repetitions (one graph compute == one step) ----
            for (int w = 0; w < 5; w++) ggml_backend_graph_compute(backend, gf);
            double t0 = now_us();
            ggml_backend_graph_compute(backend, gf);
            double one = now_us() - t0;
            int reps = (int)(secs * 1e6 / (one > 1 ? one : 1));
            if (reps < 20) reps = 20;
            if (reps > 5000) reps = 5000;
            double * ts = malloc(sizeof(double) * reps);
            for (int r = 0; r < reps; r++) {
                double a = now_us();
                if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
                    fprintf(stderr, "graph compute failed\n"); return 1;
                }
                ts[r] = now_us() - a;
            }
            qsort(ts, reps, sizeof(double), cmp_double);
            res_min[f][ni] = ts[0];
            res_med[f][ni] = ts[reps / 2];
            free(ts);

            // ---- check: outputs finite, checksum, classifier column 0 vs f64 reference ----
            double sum = 0.0;
            int finite = 1;
            for (int m = 0; m < NMAT; m++) {
                size_t ne = (size_t)ggml_nelements(Y[m]);
                const float * y = (const float *)Y[m]->data;  // CPU buffer: host memory
                for (size_t k = 0; k < ne; k++) { if (!isfinite(y[k])) finite = 0; sum += y[k]; }
            }
            if (!finite) { fprintf(stderr, "%s N=%d: non-finite output!\n", fmt->name, N); return 1; }
            checksum_total += sum;
            double err2 = 0.0, ref2 = 0.0;
            {
                const float * y = (const float *)Y[NMAT - 1]->data;
                for (int o = 0; o < VOCAB; o++) {
                    double ref = 0.0;
                    for (int k = 0; k < DIM; k++) ref += (double)w32[NMAT - 1][(size_t)o * DIM + k] * x_dim[k];
                    err2 += (y[o] - ref) * (y[o] - ref);
                    ref2 += ref * ref;
                }
            }
            fprintf(stderr, "  %-12s N=%-3d reps=%-5d min=%9.1f us  median=%9.1f us  checksum=%.6e  cls rel.err=%.2e\n",
                    fmt->name, N, reps, res_min[f][ni], res_med[f][ni], sum, sqrt(err2 / ref2));
            if (csv) fprintf(csv, "%s,%d,%.1f,%.1f\n", fmt->name, N, res_min[f][ni], res_med[f][ni]);

            ggml_backend_buffer_free(cbuf);
            ggml_free(cctx);
        }
        ggml_backend_buffer_free(wbuf);
        ggml_free(wctx);
    }

    // ---- table ----
    printf("\nmedian us per step (min in parentheses); weights %zu params\n", n_params);
    printf("%-12s %8s", "format", "MiB");
    for (int ni = 0; ni < n_ns; ni++) { char h[16]; snprintf(h, sizeof h, "N=%d", ns[ni]); printf(" %17s", h); }
    printf(" %12s %8s\n", "tok/s(N=1)", "GB/s N=1");
    for (int f = 0; f < NFMT_ALL; f++) {
        if (!res_ok[f]) continue;
        printf("%-12s %8.1f", ALL_FMTS[f].name, res_bytes[f] / 1048576.0);
        for (int ni = 0; ni < n_ns; ni++) {
            char c[32]; snprintf(c, sizeof c, "%.0f (%.0f)", res_med[f][ni], res_min[f][ni]);
            printf(" %17s", c);
        }
        int i1 = -1;
        for (int ni = 0; ni < n_ns; ni++) if (ns[ni] == 1) i1 = ni;
        if (i1 >= 0) printf(" %12.0f %8.1f", 1e6 / res_med[f][i1], res_bytes[f] / (res_med[f][i1] * 1e3));
        printf("\n");
    }
    printf("\nCSV\nformat,N,min_us,median_us\n");
    for (int f = 0; f < NFMT_ALL; f++) {
        if (!res_ok[f]) continue;
        for (int ni = 0; ni < n_ns; ni++) printf("%s,%d,%.1f,%.1f\n", ALL_FMTS[f].name, ns[ni], res_min[f][ni], res_med[f][ni]);
    }
    printf("checksum %.9e\n", checksum_total);

    if (csv) fclose(csv);
    for (int m = 0; m < NMAT; m++) free(w32[m]);
    free(x_dim); free(x_hid);
    ggml_backend_free(backend);
    return 0;
}
