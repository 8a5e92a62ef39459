// fpaudit's CPU histogram kernel: one pass over fp32 values, exact bins, finite amax.
//
// The bin layout is the one of fpaudit/histogram.py (zero, 277 binades x 8
// mantissa classes, inf, NaN); the class bounds come from Python so there is a
// single source of truth. Results are identical to histogram.bin_indices (the
// pure-torch reference), which the tests check on edge values and random bit
// patterns.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

namespace {

constexpr int kClasses = 8;
constexpr int64_t kBinades = 277;
constexpr uint32_t kZero = 0;
constexpr uint32_t kFirstFinite = 1;
constexpr uint32_t kInf = kFirstFinite + kBinades * kClasses;
constexpr uint32_t kNan = kInf + 1;
constexpr uint32_t kBins = kNan + 1;
// Raw bins of unnormalised subnormals (exponent field 0, fraction class 1..7).
constexpr uint32_t kRawSubnormalFirst = kFirstFinite + 22 * kClasses + 1;
// Several copies of the counters: consecutive values usually hit the same bin,
// and one counter would make every increment wait for the previous one.
constexpr int kCopies = 4;
constexpr int kBlock = 2048;

struct Bounds {
  uint32_t b1, b2, b3, b4, b5, b6, b7;  // class lower bounds 1..7 (class 0 starts at 0)
};

// Pass 1, branch-free so the compiler vectorises it: the bin of every value, with
// zero, inf and NaN chosen by selects and subnormals left in their raw bins.
// Returns the block's largest finite bit pattern; counts the subnormals and
// reports the range of nonzero bins used (only that range, and the zero bin, is
// merged and cleared).
struct BlockSummary {
  uint32_t largest;
  uint32_t subnormals;
  uint32_t low;
  uint32_t high;
};

__attribute__((target_clones("avx2", "default")))
BlockSummary block_bins(const uint32_t* __restrict data, uint32_t* __restrict bins, int count,
                        const Bounds& bounds) {
  const uint32_t b1 = bounds.b1, b2 = bounds.b2, b3 = bounds.b3, b4 = bounds.b4;
  const uint32_t b5 = bounds.b5, b6 = bounds.b6, b7 = bounds.b7;
  // A signed max: GCC vectorises it, not the unsigned one. Finite |x| bits are < 2**31.
  int32_t largest = 0;
  uint32_t subnormals = 0;
  int32_t low = int32_t(kBins), high = 0;  // signed min/max: vectorised, bins < 2**31
  for (int j = 0; j < count; ++j) {
    const uint32_t bits = data[j] & 0x7FFFFFFFu;
    const uint32_t fraction = bits & 0x7FFFFFu;
    const uint32_t cls = uint32_t(fraction >= b1) + uint32_t(fraction >= b2) +
                         uint32_t(fraction >= b3) + uint32_t(fraction >= b4) +
                         uint32_t(fraction >= b5) + uint32_t(fraction >= b6) +
                         uint32_t(fraction >= b7);
    // binade - (-149) = exponent - 127 + 149 for normal numbers; exponent 255 lands on
    // kInf + cls, and min() folds NaN's classes 1..7 onto kNan.
    uint32_t bin = kFirstFinite + ((bits >> 23) + 22) * kClasses + cls;
    bin = std::min(bin, kNan);
    bins[j] = bits == 0 ? kZero : bin;
    // The reductions read bin from before the zero select (GCC vectorises only that
    // form); zero's bin 0 is always merged separately, its raw bin is 177.
    subnormals += uint32_t(bin - kRawSubnormalFirst < kClasses - 1);
    low = std::min(low, int32_t(bin));
    high = std::max(high, int32_t(bin));
    const int32_t finite = bits < 0x7F800000u ? int32_t(bits) : 0;
    largest = std::max(largest, finite);
  }
  return BlockSummary{uint32_t(largest), subnormals, uint32_t(low), uint32_t(high)};
}

uint32_t subnormal_bin(uint32_t bits, const Bounds& b) {
  const uint32_t fraction = bits & 0x7FFFFFu;
  const int top = 31 - __builtin_clz(fraction);  // binade - (-149)
  const uint32_t g = (fraction << (23 - top)) & 0x7FFFFFu;
  const uint32_t cls = (g >= b.b1) + (g >= b.b2) + (g >= b.b3) + (g >= b.b4) + (g >= b.b5) +
                       (g >= b.b6) + (g >= b.b7);
  return kFirstFinite + uint32_t(top) * kClasses + cls;
}

}  // namespace

// Adds the values of the contiguous fp32 CPU tensor x to row `row` of `table` (int64,
// rows x at least kBins + 1 columns): columns 0..kBins-1 are the counts, column kBins
// the bit pattern of the largest finite |x| seen, raised here if x has a larger one.
// Further columns belong to the caller.
void histogram_add(const torch::Tensor& x, torch::Tensor& table, int64_t row,
                   const std::vector<int64_t>& class_bounds) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "histogram_add needs a contiguous float32 CPU tensor");
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == torch::kInt64 && table.dim() == 2 &&
                  table.size(1) > kBins && table.is_contiguous(),
              "table must be a contiguous int64 CPU tensor of shape [rows, > ", kBins, "]");
  TORCH_CHECK(row >= 0 && row < table.size(0), "row ", row, " out of range");
  TORCH_CHECK(class_bounds.size() == kClasses && class_bounds[0] == 0, "expected ", kClasses, " class bounds");
  const Bounds bounds{uint32_t(class_bounds[1]), uint32_t(class_bounds[2]), uint32_t(class_bounds[3]),
                      uint32_t(class_bounds[4]), uint32_t(class_bounds[5]), uint32_t(class_bounds[6]),
                      uint32_t(class_bounds[7])};

  const auto* data = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  int64_t* total = table.data_ptr<int64_t>() + row * table.size(1);
  int64_t* amax_out = total + kBins;
  std::mutex merge;
  const int64_t n = x.numel();
  const int64_t grain = std::max<int64_t>(int64_t(1) << 16, (n + at::get_num_threads() - 1) / at::get_num_threads());

  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    // Counter copies live per thread across calls; only the range of bins a call
    // touched is merged and cleared, so small tensors cost little. uint32 counters
    // are flushed into int64 ones long before they could overflow.
    thread_local std::vector<uint32_t> local(size_t(kCopies) * kBins, 0u);
    thread_local std::vector<int64_t> wide(kBins, 0);
    std::array<uint32_t, kBlock> bins{};
    uint32_t largest = 0, low = kBins, high = 0;
    int64_t since_flush = 0;
    auto flush = [&]() {
      for (int c = 0; c < kCopies; ++c) {
        uint32_t* counters = local.data() + size_t(c) * kBins;
        wide[kZero] += counters[kZero];
        counters[kZero] = 0;
        for (uint32_t b = low; b <= high; ++b) {
          wide[b] += counters[b];
          counters[b] = 0;
        }
      }
    };
    for (int64_t start = begin; start < end; start += kBlock) {
      const int count = int(std::min<int64_t>(kBlock, end - start));
      BlockSummary block = block_bins(data + start, bins.data(), count, bounds);
      largest = std::max(largest, block.largest);
      if (__builtin_expect(block.subnormals != 0, 0)) {  // rare: normalise them in place
        for (int j = 0; j < count; ++j) {
          if (bins[size_t(j)] - kRawSubnormalFirst < kClasses - 1) {
            bins[size_t(j)] = subnormal_bin(data[start + j], bounds);
            block.low = std::min(block.low, bins[size_t(j)]);
            block.high = std::max(block.high, bins[size_t(j)]);
          }
        }
      }
      low = std::min(low, block.low);
      high = std::max(high, block.high);
      // Pass 2: scatter into the counter copies.
      int j = 0;
      for (; j + kCopies <= count; j += kCopies) {
        for (int c = 0; c < kCopies; ++c) ++local[size_t(c) * kBins + bins[size_t(j + c)]];
      }
      for (; j < count; ++j) ++local[bins[size_t(j)]];
      since_flush += count;
      if (since_flush >= (int64_t(1) << 30)) {
        flush();
        since_flush = 0;
      }
    }
    flush();
    std::lock_guard<std::mutex> guard(merge);
    total[kZero] += wide[kZero];
    wide[kZero] = 0;
    for (uint32_t b = low; b <= high; ++b) {
      total[b] += wide[b];
      wide[b] = 0;
    }
    *amax_out = std::max<int64_t>(*amax_out, int64_t(largest));
  });
}

// ---- Block-scaled statistics (fpaudit/blockstats.py) ----
//
// Two passes over a contiguous fp32 tensor of blocks [n_blocks, block_elements]:
// block_amax (the largest |x| per block, NaN if the block holds one, as torch's
// amax) and, once Python has turned the maxima into fp32 multipliers,
// block_classify: the per-class counts, the blocks with a flushed value and the
// dynamic-range histogram, with the same fp32 product and thresholds as the
// pure-torch reference (blockstats._general_stats), which the tests check.

namespace {

constexpr uint32_t kInfBits = 0x7F800000u;
constexpr int kRanges = 277;
constexpr int kBlockCounts = 8;  // zero, flushed, subnormal, normal, saturated, nonfinite, poisoned, blocks_flushed

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

__attribute__((target_clones("avx2", "default")))
uint32_t row_amax_bits(const uint32_t* __restrict data, int64_t count) {
  int32_t largest = 0;  // |x| bits < 2**31: a signed max vectorises; NaN bits exceed inf's
  for (int64_t j = 0; j < count; ++j) largest = std::max(largest, int32_t(data[j] & 0x7FFFFFFFu));
  return uint32_t(largest);
}

struct RowCounts {
  int64_t zero, nonfinite, nonzero, flushed, subnormal, saturated;
  uint32_t top, bottom;  // finite nonzero |x| bits: largest, smallest (0x7FFFFFFF if none)
};

__attribute__((target_clones("avx2", "default")))
RowCounts row_classify(const uint32_t* __restrict data, int64_t count, float m, float zero_edge,
                       float below_normal, float overflow_edge, bool inclusive) {
  int32_t zero = 0, nonfinite = 0, nonzero = 0, flushed = 0, subnormal = 0, saturated = 0;
  int32_t top = 0, bottom = 0x7FFFFFFF;
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t u = data[j] & 0x7FFFFFFFu;
    const int32_t live = int32_t(u < kInfBits) & int32_t(u != 0);
    const float s = bits_to_float(u) * m;
    zero += int32_t(u == 0);
    nonfinite += int32_t(u >= kInfBits);
    nonzero += live;
    flushed += live & int32_t(s <= zero_edge);
    subnormal += live & int32_t(s > zero_edge) & int32_t(s < below_normal);
    saturated += live & int32_t(inclusive ? s >= overflow_edge : s > overflow_edge);
    top = std::max(top, live ? int32_t(u) : 0);
    bottom = std::min(bottom, live ? int32_t(u) : 0x7FFFFFFF);
  }
  return RowCounts{zero, nonfinite, nonzero, flushed, subnormal, saturated, uint32_t(top),
                   uint32_t(bottom)};
}

}  // namespace

// Adds one block, classified under its multiplier `m`, to `counts` (zero, flushed,
// subnormal, normal, saturated, nonfinite, poisoned), 1 to `*flushed_blocks` if it
// flushed a value, and its dynamic range floor(log2(top / bottom)), exactly from frexp,
// to `ranges` (a block without a finite nonzero value has none). A non-finite
// multiplier poisons every finite nonzero value.
inline void add_block(int64_t* counts, int64_t* flushed_blocks, int64_t* ranges,
                      const RowCounts& c, float m) {
  counts[0] += c.zero;
  counts[5] += c.nonfinite;
  if (!std::isfinite(m)) {
    counts[6] += c.nonzero;
  } else {
    counts[1] += c.flushed;
    counts[2] += c.subnormal;
    counts[3] += c.nonzero - c.flushed - c.subnormal - c.saturated;
    counts[4] += c.saturated;
    *flushed_blocks += int64_t(c.flushed > 0);
  }
  if (c.nonzero > 0) {
    int top_exponent, bottom_exponent;
    const float top_mantissa = std::frexp(bits_to_float(c.top), &top_exponent);
    const float bottom_mantissa = std::frexp(bits_to_float(c.bottom), &bottom_exponent);
    ++ranges[top_exponent - bottom_exponent - int(top_mantissa < bottom_mantissa)];
  }
}

// The largest |x| of each row of `blocks` (contiguous fp32 [n, k]), as fp32 [n];
// a row holding a NaN gives NaN, one holding inf (and no NaN) inf.
torch::Tensor block_amax(const torch::Tensor& blocks) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kFloat32 &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "block_amax needs a contiguous 2-D float32 CPU tensor");
  const int64_t n = blocks.size(0), k = blocks.size(1);
  auto out = torch::empty({n}, blocks.options().dtype(torch::kInt32));
  const auto* data = reinterpret_cast<const uint32_t*>(blocks.data_ptr<float>());
  auto* result = out.data_ptr<int32_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) result[b] = int32_t(row_amax_bits(data + b * k, k));
  });
  return out.view(torch::kFloat32);
}

// Classifies every element of `blocks` (contiguous fp32 [n, k]) scaled by its row's
// fp32 multiplier (`multiplier`, fp32 [n]): returns int64 [8 + 277]: zero, flushed,
// subnormal, normal, saturated, nonfinite, poisoned (finite nonzero under a
// non-finite multiplier), blocks with a flushed value, then the histogram of
// floor(log2(max / min)) over each row's finite nonzero |x| (rows without one are
// not counted). Padding is the caller's to subtract from the zeros.
torch::Tensor block_classify(const torch::Tensor& blocks, const torch::Tensor& multiplier,
                             double zero_edge, double below_normal, double overflow_edge,
                             bool inclusive) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kFloat32 &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "block_classify needs a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(multiplier.device().is_cpu() && multiplier.scalar_type() == torch::kFloat32 &&
                  multiplier.dim() == 1 && multiplier.is_contiguous() &&
                  multiplier.size(0) == blocks.size(0),
              "multiplier must be a contiguous float32 CPU tensor of one value per block");
  const int64_t n = blocks.size(0), k = blocks.size(1);
  const auto* data = reinterpret_cast<const uint32_t*>(blocks.data_ptr<float>());
  const float* scale = multiplier.data_ptr<float>();
  const float ze = float(zero_edge), bn = float(below_normal), oe = float(overflow_edge);
  auto out = torch::zeros({kBlockCounts + kRanges}, blocks.options().dtype(torch::kInt64));
  int64_t* total = out.data_ptr<int64_t>();
  std::mutex merge;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::array<int64_t, kBlockCounts + kRanges> local{};
    for (int64_t b = begin; b < end; ++b) {
      const float m = scale[b];
      // A row longer than 2**30 is counted in pieces (int32 counters inside).
      RowCounts c{0, 0, 0, 0, 0, 0, 0, 0x7FFFFFFFu};
      for (int64_t start = 0; start < k; start += int64_t(1) << 30) {
        const int64_t count = std::min<int64_t>(k - start, int64_t(1) << 30);
        const RowCounts p = row_classify(data + b * k + start, count, m, ze, bn, oe, inclusive);
        c.zero += p.zero;
        c.nonfinite += p.nonfinite;
        c.nonzero += p.nonzero;
        c.flushed += p.flushed;
        c.subnormal += p.subnormal;
        c.saturated += p.saturated;
        c.top = std::max(c.top, p.top);
        c.bottom = std::min(c.bottom, p.bottom);
      }
      add_block(local.data(), &local[7], local.data() + kBlockCounts, c, m);
    }
    std::lock_guard<std::mutex> guard(merge);
    for (size_t i = 0; i < local.size(); ++i) total[i] += local[i];
  });
  return out;
}

namespace {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// 2**e as fp32, exactly, for integer e in [-149, 127] (blockstats._pow2).
inline float pow2(int e) {
  return bits_to_float(e >= -126 ? uint32_t(e + 127) << 23 : uint32_t(1) << (e + 149));
}

constexpr int kFloor = 0, kRceil = 1, kPow2Floor = 2;

// One block's multiplier, scale code and out-of-range flag from its amax bits, in the
// fp32 operations of blockstats.scales_from_amax (mx-floor, mx-rceil, pow2-floor).
inline float block_scale(int rule, uint32_t amax_bits, float element_max, int element_max_pow2,
                         int* code, bool* out_of_range) {
  const float amax = bits_to_float(amax_bits);
  const bool nan = amax_bits > kInfBits;
  const bool finite_nonzero = amax_bits < kInfBits && amax_bits != 0;
  if (rule == kFloor) {
    const int unbiased = int(amax_bits >> 23 & 0xFF) - 127 - element_max_pow2;
    *out_of_range = finite_nonzero && unbiased < -127;
    *code = nan ? 255 : std::min(std::max(unbiased, -127), 128) + 127;
    return *code == 255 ? std::numeric_limits<float>::quiet_NaN() : pow2(127 - std::min(*code, 254));
  }
  if (rule == kRceil) {
    const float descale = amax / element_max;
    const uint32_t bits = float_bits(descale);
    const int biased = int(bits >> 23 & 0xFF);
    const uint32_t fraction = bits & 0x7FFFFFu;
    const uint32_t half = uint32_t(1) << 22;
    int exponent;
    if (biased == 0) {
      exponent = fraction > half ? -126 : -127;
    } else {
      exponent = std::min(std::max(biased - 127 + int(fraction > 0), -127), 127);
    }
    *out_of_range = finite_nonzero && biased == 0 && fraction < half;
    *code = std::isnan(descale) ? 255 : std::isinf(descale) ? 254 : exponent + 127;
    if (*code == 255) return std::numeric_limits<float>::quiet_NaN();
    if (*code == 254) return pow2(-127);
    return *code == 0 ? 1.0f : pow2(127 - *code);
  }
  // pow2-floor: elem_max / amax in fp32, overflow clamped, rounded down to a power of two
  float multiplier = element_max / amax;
  *out_of_range = finite_nonzero && std::isinf(multiplier);
  if (std::isinf(multiplier)) multiplier = std::numeric_limits<float>::max();
  if (amax == 0.0f) multiplier = 1.0f;
  multiplier = bits_to_float(float_bits(multiplier) & ~0x7FFFFFu);
  const uint32_t bits = float_bits(multiplier);
  const int biased = int(bits >> 23 & 0xFF);
  *code = nan ? 255 : std::min(std::max(2 * 127 - biased - int((bits & 0x7FFFFFu) > 0), 0), 254);
  return nan ? std::numeric_limits<float>::quiet_NaN() : multiplier;
}

}  // namespace

// The whole statistics vector of blockstats (layout: 10 counts, 256 scale codes, 277
// ranges) for the rules whose scale depends on the block alone (rule 0 mx-floor, 1
// mx-rceil, 2 pow2-floor), in one pass over `blocks` (contiguous fp32 [n, k]): each
// block's maximum, its scale, then its elements (from the cache). `padding` zeros are
// not counted.
torch::Tensor block_stats(const torch::Tensor& blocks, int64_t rule, double element_max,
                          int64_t element_max_pow2, double zero_edge, double below_normal,
                          double overflow_edge, bool inclusive, int64_t padding) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kFloat32 &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "block_stats needs a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(rule >= kFloor && rule <= kPow2Floor, "unknown rule ", rule);
  constexpr int kCounts = 10, kCodes = 256;
  const int64_t n = blocks.size(0), k = blocks.size(1);
  const auto* data = reinterpret_cast<const uint32_t*>(blocks.data_ptr<float>());
  const float ze = float(zero_edge), bn = float(below_normal), oe = float(overflow_edge);
  const float emax = float(element_max);
  auto out = torch::zeros({kCounts + kCodes + kRanges}, blocks.options().dtype(torch::kInt64));
  int64_t* total = out.data_ptr<int64_t>();
  std::mutex merge;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::array<int64_t, kCounts + kCodes + kRanges> local{};
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* row = data + b * k;
      int code;
      bool out_of_range;
      const float m = block_scale(int(rule), row_amax_bits(row, k), emax, int(element_max_pow2),
                                  &code, &out_of_range);
      ++local[size_t(kCounts + code)];
      local[9] += int64_t(out_of_range);
      const RowCounts c = row_classify(row, k, m, ze, bn, oe, inclusive);
      add_block(local.data(), &local[8], local.data() + kCounts + kCodes, c, m);
    }
    std::lock_guard<std::mutex> guard(merge);
    for (size_t i = 0; i < local.size(); ++i) total[i] += local[i];
  });
  total[0] -= padding;
  total[7] = n;
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("histogram_add", &histogram_add, "Exact fp32 magnitude histogram (fpaudit layout)");
  m.def("block_amax", &block_amax, "Largest |x| per row (NaN-propagating)");
  m.def("block_stats", &block_stats, "Block-scaled statistics, one pass (block-local scales)");
  m.def("block_classify", &block_classify, "Block-scaled class counts and dynamic ranges");
}
