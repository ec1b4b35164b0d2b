// --- tree attention ------------------------------------------------------------------------------
//
// tree_attention: the attention of a verify or decode step's few query rows per sequence over
// keys and values read in place from the KV storage (the paged pool, or a dense cache), with the
// same fixed-order arithmetic for every row: a row's result depends only on its own query and
// the keys it sees, never on the other rows of its step. Row i of sequence b sees its context
// (positions 0 ... lengths[b] - 1) and the block positions lengths[b] + j with mask[b, i, j], in
// that order -- the order plain decoding sees the same keys in once a tree's accepted path is
// committed (a node's ancestors precede it in the block, in depth order). So with float_mm's
// batch-invariant linears a tree's verify row computes bitwise what plain decoding of the same
// token computes.
//
// Per row: scores s_k = (q . key_k) * scale (8 lanes over the head dimension, then sum_lanes'
// tree), m = max s_k, p_k = exp(s_k - m) (expf_lanes: a fixed polynomial, < 2 ulp), l = the sum
// of p_k in key order, out = (sum over k in key order of p_k v_k) / l.

#include "common.h"
#include "ops.h"

namespace ddtree_cpu {

#ifdef __AVX2__
namespace {

// q . key over D (a multiple of 8): lane j sums q[d] key[d] over d = j mod 8, then sum_lanes.
inline float head_dot(const float* q, const float* key, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += HEAD_LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(key + d), acc);
  return sum_lanes(acc);
}

// sum_lanes of four vectors at once, each by the same tree: (a0 + a4, a1 + a5, a2 + a6, a3 + a7)
// from the halves, reordered (h0, h2, h1, h3) so that one horizontal add pairs h0 + h2 and h1 +
// h3 and the next adds those two (a sum's operands may swap: IEEE addition commutes exactly).
inline __m128 sum_lanes4(const __m256 a[4]) {
  const __m256 h01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 h23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  __m256 y = _mm256_hadd_ps(_mm256_permute_ps(h01, 0xD8), _mm256_permute_ps(h23, 0xD8));
  y = _mm256_hadd_ps(y, y);  // low half (s0, s2, s0, s2), high half (s1, s3, s1, s3)
  return _mm_unpacklo_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// scores[r][t] = (q[r] . key t) * scale for R query rows over the same n keys at element offsets
// keys[t]: an R x 4 tile of (row, key) chains per step, each key's vector loaded once for the R
// rows, the four keys' lanes summed together (sum_lanes4). Every (row, key) score is head_dot's
// whatever its place.
template <int R>
void tile_scores(const float* const* q, const float* kp, const int64_t* keys, int64_t n, int64_t D, float scale,
                 float* const* scores) {
  const __m128 factor = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *k0 = kp + keys[t], *k1 = kp + keys[t + 1], *k2 = kp + keys[t + 2], *k3 = kp + keys[t + 3];
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += HEAD_LANES) {
      const __m256 v0 = _mm256_loadu_ps(k0 + d), v1 = _mm256_loadu_ps(k1 + d);
      const __m256 v2 = _mm256_loadu_ps(k2 + d), v3 = _mm256_loadu_ps(k3 + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        acc[r][0] = _mm256_fmadd_ps(qv, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qv, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qv, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) _mm_storeu_ps(scores[r] + t, _mm_mul_ps(sum_lanes4(acc[r]), factor));
  }
  for (; t < n; ++t)
    for (int r = 0; r < R; ++r) scores[r][t] = head_dot(q[r], kp + keys[t], D) * scale;
}

// The context's share of R rows' value sums (rows of one sequence and key-value head share its
// keys): out[r][d0 ... d0 + VLANES STEPS) = sum over t < n, in key order, of p[r][t] value t, not
// yet divided by l -- each value vector loaded once for the R rows, every output lane its own
// chain of fused multiply-adds in key order, held in registers, which finish_values continues
// over the row's own block keys. A lane's chain is the same whatever the vectors' width, so the
// AVX-512 build's 16 lanes sum exactly what 8 lanes do.
template <int R, int STEPS>
void context_values(const float* vp, const int64_t* keys, const float* const* p, int64_t n, int64_t d0, float* const* out) {
  Vec acc[R][STEPS];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < STEPS; ++s) acc[r][s] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const float* v = vp + keys[t] + d0;
    Vec w[R];
    for (int r = 0; r < R; ++r) w[r] = vsplat(p[r][t]);
    for (int s = 0; s < STEPS; ++s) {
      const Vec vs = vload(v + s * VLANES);
      for (int r = 0; r < R; ++r) acc[r][s] = vfmadd(w[r], vs, acc[r][s]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < STEPS; ++s) vstore(out[r] + d0 + s * VLANES, acc[r][s]);
}

// The same over 8 lanes: the last 8 of a head dimension that is an odd multiple of 8 (AVX-512).
template <int R>
void context_values8(const float* vp, const int64_t* keys, const float* const* p, int64_t n, int64_t d0, float* const* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 vs = _mm256_loadu_ps(vp + keys[t] + d0);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][t]), vs, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r] + d0, acc[r]);
}

// context_values over the whole head dimension, 4 vectors per row at a time.
template <int R>
void rows_context_values(const float* vp, const int64_t* keys, const float* const* p, int64_t n, int64_t D, float* const* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * VLANES <= D; d0 += 4 * VLANES) context_values<R, 4>(vp, keys, p, n, d0, out);
  for (; d0 + VLANES <= D; d0 += VLANES) context_values<R, 1>(vp, keys, p, n, d0, out);
  for (; d0 < D; d0 += HEAD_LANES) context_values8<R>(vp, keys, p, n, d0, out);
}

// A row's value sums continued from out (its context's share) over its n block keys, in block
// order, then divided by l; all of a row's vectors per key (independent chains). A row's result
// is the same whatever rows share its tile.
void finish_values(const float* vp, const int64_t* keys, const float* p, int64_t n, int64_t D, float l, float* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * VLANES <= D; d0 += 4 * VLANES) {
    Vec acc[4];
    for (int s = 0; s < 4; ++s) acc[s] = vload(out + d0 + s * VLANES);
    for (int64_t t = 0; t < n; ++t) {
      const Vec w = vsplat(p[t]);
      for (int s = 0; s < 4; ++s) acc[s] = vfmadd(w, vload(vp + keys[t] + d0 + s * VLANES), acc[s]);
    }
    const Vec sum = vsplat(l);
    for (int s = 0; s < 4; ++s) vstore(out + d0 + s * VLANES, vdiv(acc[s], sum));
  }
  const __m256 sum = _mm256_set1_ps(l);
  for (; d0 < D; d0 += HEAD_LANES) {
    __m256 acc = _mm256_loadu_ps(out + d0);
    for (int64_t t = 0; t < n; ++t) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vp + keys[t] + d0), acc);
    _mm256_storeu_ps(out + d0, _mm256_div_ps(acc, sum));
  }
}

}  // namespace

// q [B, Hq, Q, D] float32; k, v: a layer's storage, any shape, float32 contiguous; offsets [B, S]
// int64: the element offset in k / v of position p's key for key-value head 0 of sequence b
// (key-value head g at + g * head_stride; query head h reads g = h / (Hq / kv_heads));
// lengths [B] int64; mask [B, Q, Q] bool; rows [B] int64 or none: sequence b's block rows past
// rows[b] are padding, not computed (their output is zero) -> [B, Hq, Q, D].
// packed (rows given): q holds the real rows alone, [N, Hq, D] with N = sum of rows (sequence b's
// rows after those of sequences 0 ... b - 1, workers.model.Packing's order) -> [N, Hq, D]: the
// forward need not lay its rows out padded and back at every layer (at 4 streams, 2-6 ms of a
// 63 ms verify of trees of unequal sizes). Each row's arithmetic is the padded layout's.
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          int64_t kv_heads, int64_t head_stride, const at::Tensor& lengths, const at::Tensor& mask,
                          double scale, const std::optional<at::Tensor>& rows, bool packed) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "ddtree_cpu.tree_attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "tree_attention is float32");
  TORCH_CHECK(!packed || rows.has_value(), "packed queries need rows");
  const int64_t dims = packed ? 3 : 4;
  TORCH_CHECK(q.dim() == dims && q.size(dims - 1) % HEAD_LANES == 0 && q.size(dims - 1) <= 512,
              packed ? "packed q must be [N, Hq, D]" : "q must be [B, Hq, Q, D]", " with D a multiple of 8, at most 512");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "query heads (", q.size(1), ") must be a multiple of kv_heads");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous storage");
  const int64_t B = packed ? offsets.size(0) : q.size(0), Hq = q.size(1), D = q.size(dims - 1);
  const int64_t Q = packed ? mask.size(1) : q.size(2);
  TORCH_CHECK(offsets.dim() == 2 && offsets.size(0) == B && offsets.scalar_type() == at::kLong, "offsets must be [B, S] int64");
  TORCH_CHECK(lengths.numel() == B && lengths.scalar_type() == at::kLong, "lengths must be [B] int64");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == Q && mask.size(2) == Q && mask.scalar_type() == at::kBool,
              "mask must be [B, Q, Q] bool");
  const int64_t S = offsets.size(1);
  // packed queries are read in place where each row's heads lie contiguous (q split from the
  // rotated q and k of one op), not copied once more a layer
  at::Tensor qc = packed && q.stride(2) == 1 && q.stride(1) == D ? q : q.contiguous();
  at::Tensor oc = offsets.contiguous(), lc = lengths.contiguous(), mc = mask.contiguous();
  const int64_t q_row = packed ? qc.stride(0) : Hq * D;
  const int64_t* len = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + Q <= S, "sequence ", b, ": ", len[b], " + ", Q, " positions exceed the ", S, " offsets");
  std::vector<int64_t> real(B, Q);  // block rows computed per sequence
  if (rows.has_value()) {
    TORCH_CHECK(rows->numel() == B && rows->scalar_type() == at::kLong, "rows must be [B] int64");
    const at::Tensor rc = rows->contiguous();
    for (int64_t b = 0; b < B; ++b) {
      real[b] = rc.data_ptr<int64_t>()[b];
      TORCH_CHECK(real[b] >= 0 && real[b] <= Q, "sequence ", b, ": ", real[b], " rows of a ", Q, "-row block");
    }
  }
  std::vector<int64_t> start(B);  // packed: sequence b's first row
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    start[b] = total;
    total += real[b];
  }
  TORCH_CHECK(!packed || total == q.size(0), "packed q has ", q.size(0), " rows; rows sum to ", total);
  at::Tensor out = packed ? at::empty({q.size(0), Hq, D}, q.options())
                          : rows.has_value() ? at::zeros({B, Hq, Q, D}, q.options()) : at::empty({B, Hq, Q, D}, q.options());
  // where row i of sequence b, query head h, lies in out, and in q
  auto at_row = [&](int64_t b, int64_t h, int64_t i) { return packed ? ((start[b] + i) * Hq + h) * D : ((b * Hq + h) * Q + i) * D; };
  auto q_at = [&](int64_t b, int64_t h, int64_t i) { return packed ? (start[b] + i) * q_row + h * D : at_row(b, h, i); };
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t* off = oc.data_ptr<int64_t>();
  const bool* mp = mc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t per_kv = Hq / kv_heads;
  const float sc = static_cast<float>(scale);
  // work items: up to TILE_ROWS query rows of one sequence that share a key-value head (so its
  // context keys), scored against those keys together
  constexpr int64_t TILE_ROWS = 3;
  const int64_t group_rows = per_kv * Q, tiles = (group_rows + TILE_ROWS - 1) / TILE_ROWS;
  // the tiles that hold real rows, (b * kv_heads + g) * tiles + tile, split evenly between the
  // threads: split over every tile of the padded width, a step of one 17-row tree and three
  // 1-row ones gave one thread 54 of the 60 real tiles (SmolLM2's heads at 300 positions: 221 us
  // a call, 157 balanced; four 5-row trees 115-126)
  std::vector<int64_t> work;
  work.reserve(B * kv_heads * tiles);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t tile = 0; tile * TILE_ROWS < per_kv * real[b]; ++tile) work.push_back((b * kv_heads + g) * tiles + tile);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(TILE_ROWS * (S + HEAD_LANES));
    std::vector<int64_t> keys(S), block_keys(TILE_ROWS * Q);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t item = work[index];
      const int64_t b = item / (kv_heads * tiles), g = (item / tiles) % kv_heads, tile = item % tiles;
      const int64_t head = g * head_stride, context = len[b], nb = real[b];
      // this sequence's rows: query head g * per_kv + r / nb, block row r % nb, for r < per_kv * nb
      const int64_t first = tile * TILE_ROWS, rows = std::min(TILE_ROWS, per_kv * nb - first);  // >= 1: a real tile
      const float* qrows[TILE_ROWS];
      float* scores[TILE_ROWS];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = g * per_kv + (first + r) / nb, i = (first + r) % nb;
        qrows[r] = qp + q_at(b, h, i);
        scores[r] = buffer.data() + r * (S + HEAD_LANES);
      }
      for (int64_t p = 0; p < context; ++p) keys[p] = off[b * S + p] + head;
      switch (rows) {
        case 3: tile_scores<3>(qrows, kp, keys.data(), context, D, sc, scores); break;
        case 2: tile_scores<2>(qrows, kp, keys.data(), context, D, sc, scores); break;
        default: tile_scores<1>(qrows, kp, keys.data(), context, D, sc, scores); break;
      }
      float* outs[TILE_ROWS];
      float totals[TILE_ROWS];
      int64_t seen[TILE_ROWS];  // block keys each row sees
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = g * per_kv + (first + r) / nb, i = (first + r) % nb;
        outs[r] = op + at_row(b, h, i);
        float* sp = scores[r];
        int64_t* own = block_keys.data() + r * Q;
        seen[r] = 0;  // then the block keys this row sees, in block order
        for (int64_t j = 0; j < Q; ++j)
          if (mp[(b * Q + i) * Q + j]) own[seen[r]++] = off[b * S + context + j] + head;
        float* tail = sp + context;
        tile_scores<1>(&qrows[r], kp, own, seen[r], D, sc, &tail);
        const int64_t n = context + seen[r];
        __m256 top = _mm256_set1_ps(-INFINITY);  // the maximum, any order (exact)
        int64_t t = 0;
        for (; t + HEAD_LANES <= n; t += HEAD_LANES) top = _mm256_max_ps(top, _mm256_loadu_ps(sp + t));
        alignas(32) float lanes[HEAD_LANES];
        _mm256_store_ps(lanes, top);
        float m = lanes[0];
        for (int64_t j = 1; j < HEAD_LANES; ++j) m = std::max(m, lanes[j]);
        for (; t < n; ++t) m = std::max(m, sp[t]);
        for (t = 0; t < n; ++t) sp[t] -= m;
        expf_lanes(sp, n);
        // l: lane j sums the p_t with t = j mod 8 in key order (the tail padded with zeros), then sum_lanes
        const int64_t padded = (n + HEAD_LANES - 1) / HEAD_LANES * HEAD_LANES;
        for (t = n; t < padded; ++t) sp[t] = 0.0f;
        __m256 total = _mm256_setzero_ps();
        for (t = 0; t < padded; t += HEAD_LANES) total = _mm256_add_ps(total, _mm256_loadu_ps(sp + t));
        totals[r] = sum_lanes(total);
      }
      // out = (sum over the keys in order of p_t value t) / l: the shared context keys for the
      // tile's rows together, then each row's own block keys
      switch (rows) {
        case 3: rows_context_values<3>(vp, keys.data(), scores, context, D, outs); break;
        case 2: rows_context_values<2>(vp, keys.data(), scores, context, D, outs); break;
        default: rows_context_values<1>(vp, keys.data(), scores, context, D, outs); break;
      }
      for (int64_t r = 0; r < rows; ++r)
        finish_values(vp, block_keys.data() + r * Q, scores[r] + context, seen[r], D, totals[r], outs[r]);
    }
  });
  return out;
}

#else
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                          int64_t kv_heads, int64_t head_stride, const at::Tensor& lengths, const at::Tensor& mask,
                          double scale, const std::optional<at::Tensor>& rows, bool packed) {
  TORCH_CHECK(false, "ddtree_cpu.tree_attention is built for AVX2 CPUs (torch's SDPA serves elsewhere)");
}
#endif

}  // namespace ddtree_cpu
