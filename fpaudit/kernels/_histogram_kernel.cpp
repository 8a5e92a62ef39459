// fpaudit's CPU histogram kernel: exact bins and finite amax of fp32, fp16, bf16 and fp8
// values read in their own dtype (see add_dense: small tensors in one block, large fp32
// ones by their top 16 bits (the values those cannot bin, and mid-sized tensors, by raw
// bin), large narrow ones by bit pattern, each folded into bins once per call).
//
// The bin layout is the one of fpaudit/histogram.py (zero, 277 binades x 8
// mantissa classes, inf, NaN); the class bounds come from Python so there is a
// single source of truth. Results are identical to histogram.bin_indices (the
// pure-torch reference), which the tests check on edge values and random bit
// patterns.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>  // the AVX-512 first pass of large fp32 tensors (split_avx512)
#endif

#if __has_include(<sys/mman.h>)  // POSIX: the tables' 2 MB pages (histogram_table)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
// AVX-512 where the machine has it: 16 lanes (measured 1.8x faster than AVX2 on this
// first pass); chosen at load time, so a cached build runs on any x86-64.
#define FPAUDIT_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FPAUDIT_CLONES __attribute__((target_clones("avx2", "default")))
#endif

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

FPAUDIT_CLONES
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

void check_table(const torch::Tensor& table) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == torch::kInt64 && table.dim() == 2 &&
                  table.size(1) > kBins && table.is_contiguous(),
              "table must be a contiguous int64 CPU tensor of shape [rows, > ", kBins, "]");
}

Bounds bounds_of(const std::vector<int64_t>& class_bounds) {
  TORCH_CHECK(class_bounds.size() == kClasses && class_bounds[0] == 0, "expected ", kClasses, " class bounds");
  return Bounds{uint32_t(class_bounds[1]), uint32_t(class_bounds[2]), uint32_t(class_bounds[3]),
                uint32_t(class_bounds[4]), uint32_t(class_bounds[5]), uint32_t(class_bounds[6]),
                uint32_t(class_bounds[7])};
}

// A tensor of at most kSmall values (most backward outputs of small models, many of
// large ones): binned into the row directly, with no counter copies to merge and clear.
// What it reads and writes is the values, their bins and the row's counters they hit,
// so a call that finds the caches cold (the engine and Python ran since the last one)
// costs little more than a warm one. Same bins as the blocked path (block_bins).
constexpr int64_t kSmall = kBlock;

// A row's span: the range [low, high] of the bins other than zero's that adds have
// touched since it was cleared (a superset: it may hold zero counts), kept beside the
// table so that closing a step reads and clears those bins alone (histogram_nonzero,
// histogram_clear). nullptr: no span kept.
void widen(int64_t* span, uint32_t low, uint32_t high) {
  if (span == nullptr) return;
  span[0] = std::min<int64_t>(span[0], int64_t(low));
  span[1] = std::max<int64_t>(span[1], int64_t(high));
}

// The cache lines of counters [low, high] of a row, fetched ahead of the scatter that
// writes them: a row is 17 KB and a step's table many MB, so a small tensor's row is
// usually out of the near caches, and the scatter's increments would wait on one line
// after another (each depends on the last write to its counter).
inline void prefetch_counters(int64_t* total, uint32_t low, uint32_t high) {
  constexpr uint32_t kPerLine = 64 / sizeof(int64_t);
  for (uint32_t b = low & ~(kPerLine - 1); b <= high; b += kPerLine) {
    __builtin_prefetch(total + b, 1, 3);
  }
}

// add_small's first pass: the bins of `count` values (subnormals normalised), whose
// counters in the row at `total` are then fetched ahead of the scatter.
BlockSummary small_bins(const uint32_t* data, uint32_t* bins, int count, int64_t* total,
                        const Bounds& bounds) {
  BlockSummary block = block_bins(data, bins, count, bounds);
  if (__builtin_expect(block.subnormals != 0, 0)) {
    for (int j = 0; j < count; ++j) {
      if (bins[j] - kRawSubnormalFirst < kClasses - 1) {
        bins[j] = subnormal_bin(data[j], bounds);
        block.low = std::min(block.low, bins[j]);
      }
    }
  }
  if (block.low <= block.high) prefetch_counters(total, block.low, block.high);
  return block;
}

// add_small's second pass: the counts, the amax and the span.
void scatter_small(const uint32_t* bins, int count, const BlockSummary& block, int64_t* total,
                   int64_t* span) {
  for (int j = 0; j < count; ++j) ++total[bins[j]];
  total[kBins] = std::max<int64_t>(total[kBins], int64_t(block.largest));
  widen(span, block.low, block.high);
}

void prefetch_row_ends(int64_t* total, int64_t* span) {
  __builtin_prefetch(total + kZero, 1, 3);  // the zero bin and amax: known before the bins
  __builtin_prefetch(total + kBins, 1, 3);
  if (span != nullptr) __builtin_prefetch(span, 1, 3);
}

void add_small(const uint32_t* data, int count, int64_t* total, const Bounds& bounds,
               int64_t* span) {
  uint32_t bins[kSmall];  // written before read: no initialisation
  prefetch_row_ends(total, span);
  const BlockSummary block = small_bins(data, bins, count, total, bounds);
  scatter_small(bins, count, block, total, span);
}

// ---- Large tensors: raw bins, folded once per call ----
//
// Measured (docs/performance.md, issue 55): the first pass, not the scatter, was most of
// a large fp32 tensor's time; the zero and NaN selects and four reductions cost as much
// as the class. A large tensor's values are now counted by their raw bin, the exponent
// field times 8 plus the class (0..2047, a function of the bits alone), and the raw bins
// are turned into the layout's bins once per call: raw bin r of a normal number is bin
// r + kRawToBin; raw bin 0 holds the zeros, 1..7 the subnormals (counted again exactly,
// only when there are any), 2040 inf and 2041..2047 NaN.
constexpr uint32_t kRawBins = 256 * kClasses;
constexpr uint32_t kRawToBin = kFirstFinite + 22 * kClasses;  // 177
constexpr uint32_t kRawInf = 255 * kClasses;
constexpr uint32_t kInfPattern = 0x7F800000u;

struct RawSummary {
  int32_t largest;   // the largest |x| bits (inf and NaN included)
  int32_t smallest;  // the smallest |x| bits (zero included)
};

// The raw bin of every |x| (branch-free; class bounds are < 2**23, so signed compares
// serve, which AVX2 has and unsigned ones it has not).
FPAUDIT_CLONES
RawSummary block_raw(const uint32_t* __restrict data, uint32_t* __restrict raw, int count,
                     const Bounds& bounds) {
  const int32_t b1 = int32_t(bounds.b1), b2 = int32_t(bounds.b2), b3 = int32_t(bounds.b3);
  const int32_t b4 = int32_t(bounds.b4), b5 = int32_t(bounds.b5), b6 = int32_t(bounds.b6);
  const int32_t b7 = int32_t(bounds.b7);
  int32_t largest = 0, smallest = 0x7FFFFFFF;
  for (int j = 0; j < count; ++j) {
    const int32_t bits = int32_t(data[j] & 0x7FFFFFFFu);
    const int32_t fraction = bits & 0x7FFFFF;
    const int32_t cls = int32_t(fraction >= b1) + int32_t(fraction >= b2) +
                        int32_t(fraction >= b3) + int32_t(fraction >= b4) +
                        int32_t(fraction >= b5) + int32_t(fraction >= b6) +
                        int32_t(fraction >= b7);
    raw[j] = uint32_t(((bits >> 20) & ~7) + cls);
    largest = std::max(largest, bits);
    smallest = std::min(smallest, bits);
  }
  return RawSummary{largest, smallest};
}

// The exact bin of one |x| bit pattern (the rare values, and the narrow dtypes' tables).
uint32_t exact_bin(uint32_t bits, const Bounds& b) {
  bits &= 0x7FFFFFFFu;
  if (bits == 0) return kZero;
  if (bits >= kInfPattern) return bits == kInfPattern ? kInf : kNan;
  if (bits < (1u << 23)) return subnormal_bin(bits, b);
  const uint32_t f = bits & 0x7FFFFFu;
  const uint32_t cls = (f >= b.b1) + (f >= b.b2) + (f >= b.b3) + (f >= b.b4) + (f >= b.b5) +
                       (f >= b.b6) + (f >= b.b7);
  return kFirstFinite + ((bits >> 23) + 22) * kClasses + cls;
}

// A source of fp32 bit patterns, a block at a time: fp32 data is read in place, narrower
// dtypes are widened (exactly) into the caller's buffer.
struct Fp32Source {
  const uint32_t* data;
  const uint32_t* block(int64_t start, int /*count*/, uint32_t* /*buffer*/) const { return data + start; }
};

template <class T, float (*Widen)(T)>
struct WideningSource {
  const T* data;
  const uint32_t* block(int64_t start, int count, uint32_t* buffer) const {
    for (int j = 0; j < count; ++j) {
      const float value = Widen(data[start + j]);
      std::memcpy(buffer + j, &value, sizeof value);
    }
    return buffer;
  }
};

// One thread's raw counters (kept across calls; only the range a call touched is folded
// and cleared): kCopies interleaved uint32 copies, folded into int64 ones long before
// they could overflow. The copies are kRawStride apart, not kRawBins: copies 8 KB apart
// put a bin's copies at addresses equal in their low 12 bits, and the CPU then held a
// load back for the store to the previous copy (4K aliasing; measured: 11% of a large
// fp32 tensor's time, docs/performance.md).
constexpr size_t kRawStride = kRawBins + 16;

struct RawCounts {
  std::vector<uint32_t> local = std::vector<uint32_t>(size_t(kCopies) * kRawStride, 0u);
  std::vector<int64_t> wide = std::vector<int64_t>(kRawBins, 0);

  void count(const uint32_t* raw, int count) {
    int j = 0;
    for (; j + kCopies <= count; j += kCopies) {
      for (int c = 0; c < kCopies; ++c) ++local[size_t(c) * kRawStride + raw[j + c]];
    }
    for (; j < count; ++j) ++local[raw[j]];
  }
  // Folds raw bins [low, high] (those of |bits| from smallest to largest) into `wide`.
  void fold(int32_t smallest, int32_t largest) {
    const uint32_t low = (uint32_t(smallest) >> 23) * kClasses;
    const uint32_t high = (uint32_t(largest) >> 23) * kClasses + kClasses - 1;
    for (int c = 0; c < kCopies; ++c) {
      uint32_t* counters = local.data() + size_t(c) * kRawStride;
      for (uint32_t r = low; r <= high; ++r) {
        wide[r] += counters[r];
        counters[r] = 0;
      }
    }
  }
};

// Bins a thread counted otherwise (the fp32 pattern path): `bins[first..last]`, cleared
// as they are merged, and `zeros`.
struct OtherBins {
  int64_t* bins;
  uint32_t first, last;
  int64_t zeros;
};

// A thread's end of a large tensor's count: its folded raw counts (of |bits| from
// smallest to largest, values [begin, end) of source) and any other bins go to the row,
// under `merge`. Subnormals (raw bins 1..7) are counted again, each in its exact bin
// (rare); the finite amax is the largest bits, unless those are inf or NaN (then the
// values are read again).
template <class Source>
void merge_raw(const Source& source, int64_t begin, int64_t end, int32_t smallest,
               int32_t largest, RawCounts& counts, const OtherBins* other,
               const Bounds& bounds, int64_t* total, int64_t* span, std::mutex& merge) {
  alignas(64) std::array<uint32_t, kBlock> buffer;  // written before read
  std::vector<int64_t>& wide = counts.wide;
  const uint32_t low = (uint32_t(smallest) >> 23) * kClasses;
  const uint32_t high = (uint32_t(largest) >> 23) * kClasses + kClasses - 1;
  std::array<int64_t, kRawToBin + kClasses> subnormal{};
  bool subnormals = false;
  for (uint32_t r = 1; r < kClasses; ++r) subnormals |= wide[r] != 0;
  if (subnormals) {
    for (int64_t start = begin; start < end; start += kBlock) {
      const int count = int(std::min<int64_t>(kBlock, end - start));
      const uint32_t* bits = source.block(start, count, buffer.data());
      for (int j = 0; j < count; ++j) {
        const uint32_t u = bits[j] & 0x7FFFFFFFu;
        if (u != 0 && u < (1u << 23)) ++subnormal[exact_bin(u, bounds)];
      }
    }
  }
  int32_t finite_largest = largest;
  if (largest >= int32_t(kInfPattern)) {
    finite_largest = 0;
    for (int64_t start = begin; start < end; start += kBlock) {
      const int count = int(std::min<int64_t>(kBlock, end - start));
      const uint32_t* bits = source.block(start, count, buffer.data());
      for (int j = 0; j < count; ++j) {
        const int32_t u = int32_t(bits[j] & 0x7FFFFFFFu);
        finite_largest = std::max(finite_largest, u < int32_t(kInfPattern) ? u : 0);
      }
    }
  }
  uint32_t first = kBins, last = 0;  // the span: bins other than zero's with a count
  std::lock_guard<std::mutex> guard(merge);
  total[kZero] += wide[0];
  wide[0] = 0;
  for (uint32_t r = 1; r < kClasses; ++r) wide[r] = 0;
  if (subnormals) {
    for (uint32_t b = kFirstFinite; b < subnormal.size(); ++b) {
      if (subnormal[b] == 0) continue;
      total[b] += subnormal[b];
      first = std::min(first, b);
      last = std::max(last, b);
    }
  }
  for (uint32_t r = std::max(low, uint32_t(kClasses)); r <= std::min(high, kRawInf - 1); ++r) {
    if (wide[r] == 0) continue;
    total[r + kRawToBin] += wide[r];
    wide[r] = 0;
    first = std::min(first, r + kRawToBin);
    last = std::max(last, r + kRawToBin);
  }
  if (high >= kRawInf) {
    for (uint32_t r = kRawInf; r < kRawBins; ++r) {
      if (wide[r] == 0) continue;
      const uint32_t b = r == kRawInf ? kInf : kNan;
      total[b] += wide[r];
      wide[r] = 0;
      first = std::min(first, b);
      last = std::max(last, b);
    }
  }
  if (other != nullptr) {
    total[kZero] += other->zeros;
    for (uint32_t b = other->first; b <= other->last && other->first <= other->last; ++b) {
      if (other->bins[b] == 0) continue;
      total[b] += other->bins[b];
      other->bins[b] = 0;
      first = std::min(first, b);
      last = std::max(last, b);
    }
  }
  total[kBins] = std::max<int64_t>(total[kBins], int64_t(finite_largest));
  if (first <= last) widen(span, first, last);
}

// Adds the n values of `source` to the row at total; each thread counts its span into
// private raw counters, folded into the row once.
template <class Source>
void add_large(const Source& source, int64_t n, int64_t* total, const Bounds& bounds,
               int64_t* span) {
  std::mutex merge;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(int64_t(1) << 16, (n + threads - 1) / threads);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    thread_local RawCounts counts;
    alignas(64) std::array<uint32_t, kBlock> buffer;  // written before read
    alignas(64) std::array<uint32_t, kBlock> raw;
    int32_t largest = 0, smallest = 0x7FFFFFFF;
    int64_t since_flush = 0;
    for (int64_t start = begin; start < end; start += kBlock) {
      const int count = int(std::min<int64_t>(kBlock, end - start));
      const RawSummary block = block_raw(source.block(start, count, buffer.data()), raw.data(), count, bounds);
      largest = std::max(largest, block.largest);
      smallest = std::min(smallest, block.smallest);
      counts.count(raw.data(), count);
      since_flush += count;
      if (since_flush >= (int64_t(1) << 30)) {
        counts.fold(smallest, largest);
        since_flush = 0;
      }
    }
    counts.fold(smallest, largest);
    merge_raw(source, begin, end, smallest, largest, counts, nullptr, bounds, total, span, merge);
  });
}

void add_fp32_patterns(const uint32_t* data, int64_t n, int64_t* total, const Bounds& bounds,
                       int64_t* span);

// Adds the n fp32 values at data to the row that starts at total (see histogram_add).
void add_values(const uint32_t* data, int64_t n, int64_t* total, const Bounds& bounds,
                int64_t* span = nullptr) {
  if (n == 0) return;
  if (n <= kSmall) {
    add_small(data, int(n), total, bounds, span);
    return;
  }
  add_fp32_patterns(data, n, total, bounds, span);
}

// ---- Narrow dtypes (fp16, bf16, fp8): counted by bit pattern ----
//
// A 16-bit value has 2**15 magnitudes (the sign bit aside), an fp8 one 2**7: a large
// tensor is counted by |pattern| into private per-thread counters (O(1) per value, no
// float work, two interleaved copies), then each pattern's count goes to its bin once
// per call, through a table (per dtype) of each pattern's bin and fp32 bits made from
// torch's own widening. Smaller tensors are widened a block at a time into the fp32
// path (no copy of the whole tensor, as before).

float widen_half(uint16_t v) { return c10::detail::fp16_ieee_to_fp32_value(v); }
float widen_bfloat16(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
float widen_e4m3fn(uint8_t v) { return c10::detail::fp8e4m3fn_to_fp32_value(v); }
float widen_e5m2(uint8_t v) { return c10::detail::fp8e5m2_to_fp32_value(v); }

struct PatternTable {
  Bounds bounds;
  std::vector<uint16_t> bin;   // per |pattern|
  std::vector<uint32_t> bits;  // per |pattern|: its fp32 |x| bits
};

bool same_bounds(const Bounds& a, const Bounds& b) {
  return a.b1 == b.b1 && a.b2 == b.b2 && a.b3 == b.b3 && a.b4 == b.b4 && a.b5 == b.b5 &&
         a.b6 == b.b6 && a.b7 == b.b7;
}

// The table of `dtype`'s patterns (made once per dtype and class bounds, then read by
// every thread without a lock: tables are never freed or changed once made).
const PatternTable& pattern_table(at::ScalarType dtype, const Bounds& bounds) {
  static std::mutex made;
  static std::deque<std::pair<at::ScalarType, PatternTable>> tables;
  std::lock_guard<std::mutex> guard(made);
  for (const auto& [kind, table] : tables) {
    if (kind == dtype && same_bounds(table.bounds, bounds)) return table;
  }
  const int64_t patterns = int64_t(1) << (8 * c10::elementSize(dtype) - 1);
  const auto storage = c10::elementSize(dtype) == 2 ? torch::kInt16 : torch::kUInt8;
  at::NoGradGuard no_grad;
  const torch::Tensor wide =
      torch::arange(patterns, torch::kInt32).to(storage).view(dtype).to(torch::kFloat32).contiguous();
  PatternTable table{bounds, std::vector<uint16_t>(size_t(patterns)), std::vector<uint32_t>(size_t(patterns))};
  const auto* values = reinterpret_cast<const uint32_t*>(wide.data_ptr<float>());
  for (int64_t p = 0; p < patterns; ++p) {
    table.bits[size_t(p)] = values[p] & 0x7FFFFFFFu;
    table.bin[size_t(p)] = uint16_t(exact_bin(values[p], bounds));
  }
  tables.emplace_back(dtype, std::move(table));
  return tables.back().second;
}

// The smallest and largest |pattern| of a block (vectorised), which bound the fold.
template <class T>
FPAUDIT_CLONES void pattern_range(const T* __restrict data, int count, int32_t* low, int32_t* high) {
  constexpr T kMask = T(~T(0)) >> 1;
  T lo = kMask, hi = 0;
  for (int j = 0; j < count; ++j) {
    const T p = T(data[j] & kMask);
    lo = std::min(lo, p);
    hi = std::max(hi, p);
  }
  *low = std::min(*low, int32_t(lo));
  *high = std::max(*high, int32_t(hi));
}

template <class T>
void add_patterns(const T* data, int64_t n, const PatternTable& table, int64_t* total, int64_t* span) {
  constexpr int kPatterns = 1 << (8 * sizeof(T) - 1);
  constexpr T kMask = T(kPatterns - 1);
  constexpr int kPatternCopies = 2;
  constexpr int kPatternBlock = 4096;
  constexpr int kLine = 64 / int(sizeof(T));  // values per cache line (a multiple of the copies)
  std::mutex merge;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(int64_t(1) << 16, (n + threads - 1) / threads);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    // The copies one cache line more than their size apart (4K aliasing: see kRawStride).
    constexpr size_t kStride = size_t(kPatterns) + 16;
    thread_local std::vector<uint32_t> local(size_t(kPatternCopies) * kStride, 0u);
    thread_local std::vector<int64_t> bins(kBins, 0);
    uint32_t* counts = local.data();
    uint32_t first = kBins, last = 0;  // bins touched (zero's included)
    int32_t amax = -1;                 // the largest finite |pattern| counted
    for (int64_t chunk = begin; chunk < end; chunk += int64_t(1) << 30) {  // uint32 counters
      const int64_t chunk_end = std::min<int64_t>(end, chunk + (int64_t(1) << 30));
      int32_t low = kPatterns, high = -1;
      for (int64_t start = chunk; start < chunk_end; start += kPatternBlock) {
        const int count = int(std::min<int64_t>(kPatternBlock, chunk_end - start));
        const T* block = data + start;
        pattern_range(block, count, &low, &high);
        int j = 0;
        for (; j + kLine <= count; j += kLine) {  // a cache line of values at a time,
          __builtin_prefetch(block + j + kPatternBlock);  // the next block's fetched
          for (int k = j; k < j + kLine; k += kPatternCopies) {
            for (int c = 0; c < kPatternCopies; ++c) ++counts[size_t(c) * kStride + (block[k + c] & kMask)];
          }
        }
        for (; j < count; ++j) ++counts[block[j] & kMask];
      }
      for (int32_t p = low; p <= high; ++p) {
        uint64_t count = 0;
        for (int c = 0; c < kPatternCopies; ++c) {
          count += counts[size_t(c) * kStride + size_t(p)];
          counts[size_t(c) * kStride + size_t(p)] = 0;
        }
        if (count == 0) continue;
        const uint32_t b = table.bin[size_t(p)];
        bins[b] += int64_t(count);
        first = std::min(first, b);
        last = std::max(last, b);
        if (table.bits[size_t(p)] < kInfPattern) amax = std::max(amax, p);
      }
    }
    std::lock_guard<std::mutex> guard(merge);
    uint32_t span_first = kBins, span_last = 0;
    for (uint32_t b = first; b <= last && first <= last; ++b) {
      if (bins[b] == 0) continue;
      total[b] += bins[b];
      bins[b] = 0;
      if (b != kZero) {
        span_first = std::min(span_first, b);
        span_last = std::max(span_last, b);
      }
    }
    if (amax >= 0) total[kBins] = std::max<int64_t>(total[kBins], int64_t(table.bits[size_t(amax)]));
    if (span_first <= span_last) widen(span, span_first, span_last);
  });
}

// ---- Large fp32 tensors: counted by their top 16 bits ----
//
// An fp32 value's top 16 bits (sign, exponent, 7 fraction bits) are a bf16 pattern, and
// for most patterns every fp32 value that starts with it has that pattern's bin: the
// class bounds fall inside only a few 7-bit fraction prefixes (0x00, 0x68 and 0x7F for
// fpaudit's layout: "ambiguous"). So a large fp32 tensor is counted as bf16 is, by
// |pattern| into private counters (no float work, no class compares), and each pattern's
// count goes to its bin (bf16's table) once per call; a first, vectorised pass over each
// block finds the values the pattern cannot bin (an ambiguous prefix, subnormals, and
// inf or NaN with a prefix of 0: 2.3% of random values), which are counted by raw bin as
// above, counts the zeros, and finds the extremes. Measured (docs/performance.md): 0.50
// ns per value against 0.59 for raw bins with padded copies and 0.66 before, on 1 M
// values at one thread.
constexpr int64_t kFp32PatternMin = int64_t(1) << 15;
constexpr size_t kPatterns16 = size_t(1) << 15;
constexpr size_t kPatternStride = kPatterns16 + 16;  // padded: see kRawStride
constexpr int kFp32PatternCopies = 4;

// Which 7-bit fraction prefixes hold a class bound other than at their start (the
// prefixes whose values the pattern cannot bin), as a table and, for the vectorised
// pass, as up to 4 values of |bits| & 0x7F0000 (repeated to fill; more than 4: none).
struct Ambiguity {
  std::array<uint8_t, 128> prefix{};
  std::array<int32_t, 4> masked{};
  bool vectorised = false;
};

Ambiguity ambiguity_of(const Bounds& b) {
  Ambiguity a;
  int found = 0;
  for (const uint32_t bound : {b.b1, b.b2, b.b3, b.b4, b.b5, b.b6, b.b7}) {
    if ((bound & 0xFFFFu) == 0 || a.prefix[bound >> 16]) continue;
    a.prefix[bound >> 16] = 1;
    if (found < 4) a.masked[size_t(found)] = int32_t(bound & 0x7F0000u);
    ++found;
  }
  for (int i = std::max(found, 1); i < 4; ++i) a.masked[size_t(i)] = a.masked[0];
  a.vectorised = found >= 1 && found <= 4;
  return a;
}

// What a block's patterns cannot tell: its zeros and the extremes of its |bits|.
struct SplitSummary {
  int32_t largest = 0;
  int32_t smallest = 0x7FFFFFFF;
  int64_t zeros = 0;
};

// The first pass, portable: writes the |bits| of the values their pattern cannot bin
// (nonzero, and subnormal or of an ambiguous prefix) to `side`, in order; returns how
// many. Branch-free: every value is stored, and the end moves past the ones kept.
int split_portable(const uint32_t* __restrict data, int count, uint32_t* __restrict side,
                   const Ambiguity& a, SplitSummary& s) {
  int kept = 0;
  for (int j = 0; j < count; ++j) {
    const uint32_t u = data[j] & 0x7FFFFFFFu;
    const uint32_t subnormal = uint32_t(u - 1 < 0x7FFFFFu);  // 1 <= u < 2**23
    const uint32_t ambiguous = uint32_t(a.prefix[(u >> 16) & 0x7F]) & uint32_t(u != 0);
    side[kept] = u;
    kept += int(subnormal | ambiguous);
    s.zeros += u == 0;
    s.largest = std::max(s.largest, int32_t(u));
    s.smallest = std::min(s.smallest, int32_t(u));
  }
  return kept;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same with AVX-512, 16 values at a time (compress-stores the kept values), fetching
// the values kSplitAhead ahead into the near cache (a prefetch never faults).
constexpr int kSplitAhead = 1024;

__attribute__((target("avx512f,popcnt"))) int split_avx512(const uint32_t* data, int count,
                                                             uint32_t* side, const Ambiguity& a,
                                                             SplitSummary& s) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), prefix = _mm512_set1_epi32(0x7F0000);
  const __m512i normal = _mm512_set1_epi32(0x800000);
  const __m512i p0 = _mm512_set1_epi32(a.masked[0]), p1 = _mm512_set1_epi32(a.masked[1]);
  const __m512i p2 = _mm512_set1_epi32(a.masked[2]), p3 = _mm512_set1_epi32(a.masked[3]);
  __m512i largest = _mm512_setzero_si512(), smallest = _mm512_set1_epi32(0x7FFFFFFF);
  int kept = 0, nonzero = 0, j = 0;
  for (; j + 16 <= count; j += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(data + j + kSplitAhead), _MM_HINT_T0);
    const __m512i u = _mm512_and_si512(_mm512_loadu_si512(data + j), magnitude);
    largest = _mm512_max_epi32(largest, u);
    smallest = _mm512_min_epi32(smallest, u);
    const __m512i masked = _mm512_and_si512(u, prefix);
    const __mmask16 live = _mm512_test_epi32_mask(u, u);
    const __mmask16 odd = live & (_mm512_cmpeq_epi32_mask(masked, p0) | _mm512_cmpeq_epi32_mask(masked, p1) |
                                  _mm512_cmpeq_epi32_mask(masked, p2) | _mm512_cmpeq_epi32_mask(masked, p3) |
                                  _mm512_cmplt_epi32_mask(u, normal));
    _mm512_storeu_si512(side + kept, _mm512_maskz_compress_epi32(odd, u));
    kept += __builtin_popcount(odd);
    nonzero += __builtin_popcount(live);
  }
  s.zeros += j - nonzero;
  s.largest = std::max(s.largest, _mm512_reduce_max_epi32(largest));
  s.smallest = std::min(s.smallest, _mm512_reduce_min_epi32(smallest));
  return kept + split_portable(data + j, count - j, side + kept, a, s);
}

// -1: not yet asked; 0: the portable pass; 1: AVX-512's (set_vector_split can turn it off).
int vector_split = -1;

bool use_avx512() {
  if (vector_split < 0) vector_split = __builtin_cpu_supports("avx512f") ? 1 : 0;
  return vector_split == 1;
}
#else
bool use_avx512() { return false; }
#endif

int split_block(const uint32_t* data, int count, uint32_t* side, const Ambiguity& a,
                SplitSummary& s) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (a.vectorised && use_avx512()) return split_avx512(data, count, side, a, s);
#endif
  return split_portable(data, count, side, a, s);
}

void add_fp32_patterns(const uint32_t* data, int64_t n, int64_t* total, const Bounds& bounds,
                       int64_t* span) {
  if (n < kFp32PatternMin) {
    add_large(Fp32Source{data}, n, total, bounds, span);
    return;
  }
  const PatternTable& table = pattern_table(torch::kBFloat16, bounds);
  const Ambiguity ambiguity = ambiguity_of(bounds);
  use_avx512();  // asked once, before the threads
  std::mutex merge;
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(int64_t(1) << 16, (n + threads - 1) / threads);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint32_t> patterns(size_t(kFp32PatternCopies) * kPatternStride, 0u);
    thread_local std::vector<int64_t> bins(kBins, 0);
    thread_local RawCounts counts;
    alignas(64) std::array<uint32_t, kBlock> side;  // written before read
    alignas(64) std::array<uint32_t, kBlock> raw;
    SplitSummary all;
    OtherBins other{bins.data(), kBins, 0, 0};
    for (int64_t chunk = begin; chunk < end; chunk += int64_t(1) << 30) {  // uint32 counters
      const int64_t chunk_end = std::min<int64_t>(end, chunk + (int64_t(1) << 30));
      SplitSummary s;
      for (int64_t start = chunk; start < chunk_end; start += kBlock) {
        const int count = int(std::min<int64_t>(kBlock, chunk_end - start));
        const uint32_t* block = data + start;
        const int kept = split_block(block, count, side.data(), ambiguity, s);
        int j = 0;
        for (; j + kFp32PatternCopies <= count; j += kFp32PatternCopies) {
          for (int c = 0; c < kFp32PatternCopies; ++c) {
            ++patterns[size_t(c) * kPatternStride + ((block[j + c] >> 16) & 0x7FFFu)];
          }
        }
        for (; j < count; ++j) ++patterns[(block[j] >> 16) & 0x7FFFu];
        if (kept > 0) {
          block_raw(side.data(), raw.data(), kept, bounds);
          counts.count(raw.data(), kept);
        }
      }
      // Each pattern's count to its bin; the ambiguous patterns' counts (and those of
      // exponent 0: zeros and subnormals) are dropped, their values counted otherwise.
      for (uint32_t p = uint32_t(s.smallest) >> 16; p <= uint32_t(s.largest) >> 16; ++p) {
        uint64_t count = 0;
        for (int c = 0; c < kFp32PatternCopies; ++c) {
          count += patterns[size_t(c) * kPatternStride + p];
          patterns[size_t(c) * kPatternStride + p] = 0;
        }
        if (count == 0 || p < 0x80 || ambiguity.prefix[p & 0x7F]) continue;
        const uint32_t b = table.bin[p];
        bins[b] += int64_t(count);
        other.first = std::min(other.first, b);
        other.last = std::max(other.last, b);
      }
      counts.fold(s.smallest, s.largest);
      other.zeros += s.zeros;
      all.largest = std::max(all.largest, s.largest);
      all.smallest = std::min(all.smallest, s.smallest);
    }
    merge_raw(Fp32Source{data}, begin, end, all.smallest, all.largest, counts, &other, bounds,
              total, span, merge);
  });
}

// A tensor below this many values is widened a block at a time instead: the fold of its
// patterns would cost more than it saves (measured: benchmarks/kernel_speed.py).
template <class T>
constexpr int64_t kPatternMin = int64_t(1) << (8 * sizeof(T) - 1);

template <class T, float (*Widen)(T)>
void add_narrow(const T* data, int64_t n, at::ScalarType dtype, int64_t* total,
                const Bounds& bounds, int64_t* span) {
  if (n == 0) return;
  const WideningSource<T, Widen> source{data};
  if (n <= kSmall) {
    alignas(64) uint32_t widened[kSmall];
    add_small(source.block(0, int(n), widened), int(n), total, bounds, span);
  } else if (n >= kPatternMin<T>) {
    add_patterns(data, n, pattern_table(dtype, bounds), total, span);
  } else {
    add_large(source, n, total, bounds, span);
  }
}

// The fp32 bits of a tensor of at most kSmall values (add_dense's kinds): its own data,
// or its values widened into `buffer`.
const uint32_t* small_fp32(const torch::Tensor& values, uint32_t* buffer) {
  const void* data = values.const_data_ptr();
  const int count = int(values.numel());
  switch (values.scalar_type()) {
    case torch::kFloat16:
      return WideningSource<uint16_t, widen_half>{static_cast<const uint16_t*>(data)}.block(0, count, buffer);
    case torch::kBFloat16:
      return WideningSource<uint16_t, widen_bfloat16>{static_cast<const uint16_t*>(data)}.block(0, count, buffer);
    case torch::kFloat8_e4m3fn:
      return WideningSource<uint8_t, widen_e4m3fn>{static_cast<const uint8_t*>(data)}.block(0, count, buffer);
    case torch::kFloat8_e5m2:
      return WideningSource<uint8_t, widen_e5m2>{static_cast<const uint8_t*>(data)}.block(0, count, buffer);
    default:
      return static_cast<const uint32_t*>(data);
  }
}

// The dtypes binned without widening the tensor first (each sign-foldable: its top bit
// is the sign); any other is widened to fp32 by torch.
bool native_dtype(at::ScalarType dtype) {
  return dtype == torch::kFloat32 || dtype == torch::kFloat16 || dtype == torch::kBFloat16 ||
         dtype == torch::kFloat8_e4m3fn || dtype == torch::kFloat8_e5m2;
}

// Adds the values of `values` (a native dtype, non-overlapping and dense: read as the
// block of memory it fills) to the row at total.
void add_dense(const torch::Tensor& values, int64_t* total, const Bounds& bounds, int64_t* span) {
  const int64_t n = values.numel();
  const void* data = values.const_data_ptr();
  switch (values.scalar_type()) {
    case torch::kFloat16:
      add_narrow<uint16_t, widen_half>(static_cast<const uint16_t*>(data), n, torch::kFloat16, total, bounds, span);
      return;
    case torch::kBFloat16:
      add_narrow<uint16_t, widen_bfloat16>(static_cast<const uint16_t*>(data), n, torch::kBFloat16, total, bounds, span);
      return;
    case torch::kFloat8_e4m3fn:
      add_narrow<uint8_t, widen_e4m3fn>(static_cast<const uint8_t*>(data), n, torch::kFloat8_e4m3fn, total, bounds, span);
      return;
    case torch::kFloat8_e5m2:
      add_narrow<uint8_t, widen_e5m2>(static_cast<const uint8_t*>(data), n, torch::kFloat8_e5m2, total, bounds, span);
      return;
    default:
      TORCH_CHECK(values.scalar_type() == torch::kFloat32, "add_dense: unexpected dtype");
      add_values(static_cast<const uint32_t*>(data), n, total, bounds, span);
  }
}

// The span of `row` in `spans` (int64 [table rows, 2], see widen), or nullptr if none.
int64_t* span_of(const c10::optional<torch::Tensor>& spans, const torch::Tensor& table, int64_t row) {
  if (!spans.has_value()) return nullptr;
  const torch::Tensor& s = *spans;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == torch::kInt64 && s.dim() == 2 &&
                  s.size(0) == table.size(0) && s.size(1) == 2 && s.is_contiguous(),
              "spans must be a contiguous int64 CPU tensor of shape [table rows, 2]");
  return s.data_ptr<int64_t>() + row * 2;
}

}  // namespace

// Adds the values of the contiguous fp32 CPU tensor x to row `row` of `table` (int64,
// rows x at least kBins + 1 columns): columns 0..kBins-1 are the counts, column kBins
// the bit pattern of the largest finite |x| seen, raised here if x has a larger one.
// Further columns belong to the caller.
void histogram_add(const torch::Tensor& x, torch::Tensor& table, int64_t row,
                   const std::vector<int64_t>& class_bounds,
                   const c10::optional<torch::Tensor>& spans) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "histogram_add needs a contiguous float32 CPU tensor");
  check_table(table);
  TORCH_CHECK(row >= 0 && row < table.size(0), "row ", row, " out of range");
  const Bounds bounds = bounds_of(class_bounds);
  add_values(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()), x.numel(),
             table.data_ptr<int64_t>() + row * table.size(1), bounds, span_of(spans, table, row));
}

// Whether large fp32 tensors' first pass may use AVX-512 where the CPU has it (the
// default); returns whether it could before. The portable pass gives the same counts:
// the tests run both.
bool set_vector_split(bool enabled) {
#if defined(__x86_64__) && defined(__GNUC__)
  const bool before = use_avx512();
  vector_split = enabled && __builtin_cpu_supports("avx512f") ? 1 : 0;
  return before;
#else
  (void)enabled;
  return false;
#endif
}

namespace {
Bounds stored_bounds{};
bool bounds_stored = false;

// x as values to bin in place (add_dense): in its own dtype where that is native, else
// widened to fp32 (exact for the other fp8 dtypes) and, unless its elements fill a block
// of memory once in some order of its dimensions, copied.
torch::Tensor as_binnable(torch::Tensor x) {
  if (!native_dtype(x.scalar_type())) x = x.to(torch::kFloat32);
  if (!x.is_non_overlapping_and_dense()) x = x.contiguous();
  return x;
}

void check_binnable(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.layout() == torch::kStrided && x.is_floating_point() &&
                  x.scalar_type() != torch::kFloat64,
              "histogram_add_many needs strided floating CPU tensors other than float64");
}
}  // namespace

// The class bounds histogram_add_tensor uses, given once (fpaudit.numerics.layout's).
void set_class_bounds(const std::vector<int64_t>& class_bounds) {
  stored_bounds = bounds_of(class_bounds);
  bounds_stored = true;
}

// histogram_add of one tensor of any layout and dtype histogram_add_many takes, with the
// class bounds given to set_class_bounds: the per-op call, with no Python work before it.
void histogram_add_tensor(const torch::Tensor& x, torch::Tensor& table, int64_t row,
                          const c10::optional<torch::Tensor>& spans) {
  TORCH_CHECK(bounds_stored, "set_class_bounds first");
  check_table(table);
  TORCH_CHECK(row >= 0 && row < table.size(0), "row ", row, " out of range");
  if (x.numel() == 0) return;  // as HistogramTable.add: nothing to bin, whatever its dtype
  check_binnable(x);
  at::NoGradGuard no_grad;
  add_dense(as_binnable(x), table.data_ptr<int64_t>() + row * table.size(1), stored_bounds,
            span_of(spans, table, row));
}

// histogram_add for many tensors in one call (closing a step: every parameter gradient):
// xs[i] is added to row rows[i]. Each is a strided floating CPU tensor of any layout and
// of a dtype that widens to fp32 exactly (fp32, fp16, bf16, fp8; fp64 is the caller's,
// with its out-of-range count). A tensor whose elements fill a block of memory once (any
// order of its dimensions) is read in place, as histogram.dense_flat does; others are
// copied, and narrower dtypes widened, here: a histogram does not depend on the order.
void histogram_add_many(const std::vector<torch::Tensor>& xs, torch::Tensor& table,
                        const std::vector<int64_t>& rows, const std::vector<int64_t>& class_bounds,
                        const c10::optional<torch::Tensor>& spans) {
  check_table(table);
  span_of(spans, table, 0);  // checked before anything is added
  TORCH_CHECK(xs.size() == rows.size(), "histogram_add_many needs one row per tensor");
  const Bounds bounds = bounds_of(class_bounds);
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < table.size(0), "row ", rows[i], " out of range");
    check_binnable(xs[i]);
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].numel() == 0) continue;
    add_dense(as_binnable(xs[i]), table.data_ptr<int64_t>() + rows[i] * table.size(1), bounds,
              span_of(spans, table, rows[i]));
  }
}

// Closing a step's parameter gradients by a plan (fpaudit.capture.recorder's): grads[i]
// (None: no gradient this step, skipped) goes to row rows[i] of `table` when it is what
// the plan expects there: a strided CPU tensor of dtype dtypes[i] (not float64) that is
// not a tensor subclass with a dispatch of its own (a DTensor: the caller takes its local
// shard). rows[i] == kSkip: a gradient of that dtype is not selected (nothing added);
// rows[i] == kUnplanned, or any other tensor: left to the caller. Every row is checked
// before anything is added. Returns (the rows added to, in order: one add each; the
// indices of the gradients left to the caller). With `of_params`, grads[i] is a parameter
// and its gradient is read here: reading `.grad` from Python costs half a microsecond a
// parameter. A parameter with a dispatch of its own (its `.grad` may be Python's) is left
// to the caller.
constexpr int64_t kUnplanned = -1;
constexpr int64_t kSkip = -2;

std::vector<std::vector<int64_t>> histogram_add_planned(
    const std::vector<c10::optional<torch::Tensor>>& given, torch::Tensor& table,
    const std::vector<int64_t>& rows, const std::vector<at::ScalarType>& dtypes,
    const c10::optional<torch::Tensor>& spans, bool of_params) {
  std::vector<c10::optional<torch::Tensor>> read;
  if (of_params) {
    read.reserve(given.size());
    for (const auto& param : given) {
      if (!param.has_value() || !param->defined()) {
        read.emplace_back(c10::nullopt);
      } else if (param->key_set().has(c10::DispatchKey::Python)) {
        read.emplace_back(*param);  // itself: not as planned, so left to the caller
      } else {
        const torch::Tensor& grad = param->grad();
        read.emplace_back(grad.defined() ? c10::optional<torch::Tensor>(grad) : c10::nullopt);
      }
    }
  }
  const std::vector<c10::optional<torch::Tensor>>& grads = of_params ? read : given;
  TORCH_CHECK(bounds_stored, "set_class_bounds first");
  check_table(table);
  span_of(spans, table, 0);  // checked before anything is added
  TORCH_CHECK(grads.size() == rows.size() && grads.size() == dtypes.size(),
              "histogram_add_planned needs one row and one dtype per gradient");
  for (const int64_t row : rows) {
    TORCH_CHECK(row == kUnplanned || row == kSkip || (row >= 0 && row < table.size(0)),
                "row ", row, " out of range");
  }
  std::vector<int64_t> added, left;
  added.reserve(grads.size());
  at::NoGradGuard no_grad;
  int64_t* base = table.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  // Small gradients (most of a model's: biases, norms, small layers) go in groups: the
  // group's bins first, each row's counters fetched as its bins are known, then the
  // scatters, which find them near. One at a time, each scatter waited on its row.
  constexpr int kGroup = 8;
  thread_local std::vector<uint32_t> scratch(size_t(kGroup) * kSmall);
  thread_local std::vector<uint32_t> widened(kSmall);  // a narrow gradient's fp32 bits
  struct Pending {
    const uint32_t* data;
    int count;
    int64_t* total;
    int64_t* span;
    BlockSummary block;
  };
  std::array<Pending, kGroup> group;
  int grouped = 0;
  auto flush = [&]() {
    for (int k = 0; k < grouped; ++k) {
      const Pending& p = group[size_t(k)];
      scatter_small(scratch.data() + size_t(k) * kSmall, p.count, p.block, p.total, p.span);
    }
    grouped = 0;
  };
  // The gradients and their rows were last touched during backward, long before: each
  // one a few ahead is fetched (its first values, its row's ends) while this one is binned.
  constexpr size_t kAhead = 4;
  auto prefetch = [&](size_t j) {
    if (j >= grads.size() || !grads[j].has_value() || !grads[j]->defined() || rows[j] < 0) return;
    const torch::Tensor& x = *grads[j];
    if (!x.device().is_cpu() || x.layout() != torch::kStrided || !x.has_storage()) return;
    const char* data = static_cast<const char*>(x.const_data_ptr());
    if (data == nullptr) return;
    const int64_t bytes = std::min<int64_t>(x.numel() * int64_t(x.element_size()), 256);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(data + b, 0, 3);
    prefetch_row_ends(base + rows[j] * width, nullptr);
  };
  for (size_t j = 0; j < kAhead; ++j) prefetch(j);
  for (size_t i = 0; i < grads.size(); ++i) {
    prefetch(i + kAhead);
    if (!grads[i].has_value() || !grads[i]->defined()) continue;
    const torch::Tensor& x = *grads[i];
    const bool planned = rows[i] != kUnplanned && x.scalar_type() == dtypes[i] &&
                         x.device().is_cpu() && x.layout() == torch::kStrided &&
                         x.is_floating_point() && x.scalar_type() != torch::kFloat64 &&
                         !x.key_set().has(c10::DispatchKey::Python);
    if (!planned) {
      left.push_back(int64_t(i));
      continue;
    }
    if (rows[i] == kSkip) continue;
    added.push_back(rows[i]);
    if (x.numel() == 0) continue;
    const torch::Tensor values = as_binnable(x);  // binned below, before it goes
    int64_t* total = base + rows[i] * width;
    int64_t* span = span_of(spans, table, rows[i]);
    if (values.numel() > kSmall) {
      add_dense(values, total, stored_bounds, span);
      continue;
    }
    const uint32_t* data = small_fp32(values, widened.data());
    prefetch_row_ends(total, span);
    Pending& p = group[size_t(grouped)];
    p = Pending{data, int(values.numel()), total, span, BlockSummary{}};
    p.block = small_bins(data, scratch.data() + size_t(grouped) * kSmall, p.count, total,
                         stored_bounds);
    if (++grouped == kGroup) flush();
  }
  flush();
  return {added, left};
}

// ---- Closing a step: the rows' nonzero bins, and clearing them ----

namespace {
// The bins of a row to read or clear: its span (see widen), or every bin without one.
std::pair<int64_t, int64_t> bins_to_visit(const int64_t* spans, int64_t row) {
  if (spans == nullptr) return {0, int64_t(kBins) - 1};
  return {std::max<int64_t>(spans[2 * row], 0), std::min<int64_t>(spans[2 * row + 1], kBins - 1)};
}

// Rows read or cleared one after another lie 17 KB apart, where the hardware prefetcher
// does not follow: each row's first lines would be a wait on memory. A row a few ahead
// is fetched while this one is visited: its zero bin, its span's bins and its columns
// from the inf bin on (amax and the caller's, which the host reads next).
constexpr int64_t kRowsAhead = 4;

void prefetch_row(const int64_t* table, int64_t width, const int64_t* spans, int64_t row,
                  int64_t rows) {
  if (row >= rows) return;
  const int64_t* data = table + row * width;
  __builtin_prefetch(data, 0, 3);
  const auto [low, high] = bins_to_visit(spans, row);
  if (spans != nullptr) {
    for (int64_t b = low; b <= high; b += 8) __builtin_prefetch(data + b, 0, 3);
  }
  __builtin_prefetch(data + kInf, 0, 3);
  __builtin_prefetch(data + width - 1, 0, 3);
}
// Zeroes one row as histogram_clear does (its visited bins, its zero bin and the columns
// after the bins, only entries that are not zero) and empties its span.
void clear_row(int64_t* row, int64_t width, int64_t* span, int64_t r) {
  const auto [low, high] = bins_to_visit(span, r);
  for (int64_t b = low; b <= high; ++b) {
    if (row[b] != 0) row[b] = 0;
  }
  if (row[kZero] != 0) row[kZero] = 0;
  for (int64_t c = kBins; c < width; ++c) {
    if (row[c] != 0) row[c] = 0;
  }
  if (span != nullptr) {
    span[2 * r] = kBins;
    span[2 * r + 1] = -1;
  }
}

// clear_row's work but for the finite bins (a caller that cleared those itself): the zero
// bin, every column from the inf bin on, and the span.
void clear_edges(int64_t* row, int64_t width, int64_t* span, int64_t r) {
  if (row[kZero] != 0) row[kZero] = 0;
  for (int64_t c = kInf; c < width; ++c) {
    if (row[c] != 0) row[c] = 0;
  }
  if (span != nullptr) {
    span[2 * r] = kBins;
    span[2 * r + 1] = -1;
  }
}
}  // namespace

// The nonzero finite bins (kFirstFinite .. kInf - 1) of rows [0, rows) of `table`, in
// row-major order: three int64 vectors (row, offset from kFirstFinite, count), what
// ReportBuilder computes from a bool mask of every bin with numpy. With `spans`, each
// row's span alone is read (a few cache lines where the whole row is 17 KB). Also, read
// in the same pass while each row's lines are in cache: each row's sum of its finite
// counts (int64 [rows]) and its edges (int64 [rows, 1 + width - kInf]: the zero bin, then
// the columns from the inf bin on: inf, NaN, amax and the caller's), which the host read
// column by column from the table before, a cold cache line per row and column. With
// `clear`, each row is then cleared as histogram_clear would, while it is in cache: what
// was read is all a caller without a window needs of the rows.
std::vector<torch::Tensor> histogram_nonzero(torch::Tensor& table, int64_t rows,
                                             const c10::optional<torch::Tensor>& spans,
                                             bool clear) {
  check_table(table);
  TORCH_CHECK(rows >= 0 && rows <= table.size(0), "rows ", rows, " out of range");
  int64_t* span = rows ? span_of(spans, table, 0) : nullptr;
  const int64_t width = table.size(1);
  int64_t* data = table.data_ptr<int64_t>();
  const int64_t edge_width = 1 + width - int64_t(kInf);
  auto finite_sums = torch::empty({rows}, torch::kInt64);
  auto edges = torch::empty({rows, edge_width}, torch::kInt64);
  int64_t* sum_of = finite_sums.data_ptr<int64_t>();
  int64_t* edge_of = edges.data_ptr<int64_t>();
  // A row's visited bins are tested 64 at a time into a bit mask (no branch, no store per
  // bin: most visited bins are zero), and an entry is written for each set bit alone. The
  // room is kept between calls (one step's worth, per thread, up to 2 MB a vector):
  // memory new at each call cost a page fault per 4 KB.
  thread_local std::vector<int64_t> row_of, offset_of, count_of;
  int64_t n = 0;
  for (int64_t r = 0; r < std::min(rows, kRowsAhead); ++r) prefetch_row(data, width, span, r, rows);
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_row(data, width, span, r + kRowsAhead, rows);
    int64_t* counts = data + r * width;
    int64_t* edge = edge_of + r * edge_width;
    edge[0] = counts[kZero];
    std::memcpy(edge + 1, counts + kInf, size_t(width - kInf) * sizeof(int64_t));
    const auto [low, high] = bins_to_visit(span, r);
    const int64_t first = std::max<int64_t>(low, kFirstFinite);
    const int64_t last = std::min<int64_t>(high, kInf - 1);
    int64_t sum = 0;
    if (first <= last) {
      const size_t room = size_t(n + (last - first + 1));
      if (room > row_of.size()) {
        const size_t grown = std::max(room, 2 * row_of.size());
        row_of.resize(grown);
        offset_of.resize(grown);
        count_of.resize(grown);
      }
      int64_t* out_row = row_of.data();
      int64_t* out_offset = offset_of.data();
      int64_t* out_count = count_of.data();
      for (int64_t start = first; start <= last; start += 64) {
        const int64_t stop = std::min<int64_t>(last, start + 63);
        uint64_t mask = 0;
        for (int64_t b = start; b <= stop; ++b) mask |= uint64_t(counts[b] != 0) << (b - start);
        while (mask != 0) {
          const int64_t b = start + __builtin_ctzll(mask);
          mask &= mask - 1;
          const int64_t count = counts[b];
          out_row[n] = r;
          out_offset[n] = b - kFirstFinite;
          out_count[n] = count;
          ++n;
          sum += count;
          if (clear) counts[b] = 0;
        }
      }
    }
    sum_of[r] = sum;
    // cleared: the finite bins above; what is left is what clear_row clears outside them
    if (clear) clear_edges(counts, width, span, r);
  }
  auto vector_of = [n](std::vector<int64_t>& values) {
    auto out = torch::empty({n}, torch::kInt64);
    if (n) std::memcpy(out.data_ptr<int64_t>(), values.data(), size_t(n) * sizeof(int64_t));
    constexpr size_t kKept = size_t(1) << 18;  // 2 MB a vector at most stays between calls
    if (values.size() > kKept) std::vector<int64_t>().swap(values);
    return out;
  };
  return {vector_of(row_of), vector_of(offset_of), vector_of(count_of), finite_sums, edges};
}

// Zeroes rows [0, rows) of `table`: with `spans`, each row's span, its zero bin and the
// columns after the bins (amax and the caller's), then empties the spans; without, the
// whole rows. Either way only entries that are not zero are written: a memset of the
// whole table wrote (and later wrote back) every cache line of it.
void histogram_clear(torch::Tensor& table, int64_t rows, const c10::optional<torch::Tensor>& spans) {
  check_table(table);
  TORCH_CHECK(rows >= 0 && rows <= table.size(0), "rows ", rows, " out of range");
  int64_t* span = rows ? span_of(spans, table, 0) : nullptr;
  const int64_t width = table.size(1);
  int64_t* data = table.data_ptr<int64_t>();
  for (int64_t r = 0; r < std::min(rows, kRowsAhead); ++r) prefetch_row(data, width, span, r, rows);
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_row(data, width, span, r + kRowsAhead, rows);
    clear_row(data + r * width, width, span, r);
  }
}

// ---- Block-scaled statistics (fpaudit/blockstats.py) ----
//
// The whole statistics vector of a contiguous fp32 tensor of blocks [n, k] under one
// scale rule, with the same fp32 operations and thresholds as the pure-torch
// reference (blockstats.scales_from_amax and blockstats._general_stats), which the
// tests check bit for bit. Rules whose scale needs the tensor's maximum (nvfp4, the
// per-tensor rules) take one more pass over the values for it.

namespace {

constexpr uint32_t kInfBits = 0x7F800000u;
constexpr int32_t kNoValue = 0x7FFFFFFF;  // "smallest finite nonzero |x|" of a block without one
constexpr int kRanges = 277;
constexpr int kCounts = 10;  // zero .. poisoned, blocks, blocks_flushed, scales_out_of_range
constexpr int kCodes = 256;
constexpr int kWidth = kCounts + kCodes + kRanges;
constexpr int kLanes = 8;
// int32 lane counters are moved into int64 ones after this many values (2**27 per lane)
constexpr int64_t kLaneFlush = int64_t(1) << 30;

typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// 2**e as fp32, exactly, for integer e in [-149, 127] (blockstats._pow2).
inline float pow2(int e) {
  return bits_to_float(e >= -126 ? uint32_t(e + 127) << 23 : uint32_t(1) << (e + 149));
}

constexpr int kFloor = 0, kRceil = 1, kPow2Floor = 2, kNvfp4 = 3, kAmax = 4;

// The per-block helpers below are always inlined into the target_clones loops: a call
// from AVX2 code into a default-target (SSE-encoded) function stalls on the AVX-SSE
// transition, which cost more than the block's whole classification.

struct Rule {
  int rule;
  float element_max;
  int element_max_pow2;
  uint32_t tensor_amax_bits;  // nvfp4: the largest |x| of the tensor (NaN if it holds one)
};

// One block's multiplier, scale code and out-of-range flag from its amax bits, in the
// fp32 operations of blockstats.scales_from_amax.
__attribute__((always_inline)) inline float block_scale(const Rule& r, uint32_t amax_bits, int* code, bool* out_of_range) {
  const float amax = bits_to_float(amax_bits);
  const bool nan = amax_bits > kInfBits;
  const bool finite_nonzero = amax_bits < kInfBits && amax_bits != 0;
  if (r.rule == kFloor) {
    const int unbiased = int(amax_bits >> 23 & 0xFF) - 127 - r.element_max_pow2;
    *out_of_range = finite_nonzero && unbiased < -127;
    *code = nan ? 255 : std::min(std::max(unbiased, -127), 128) + 127;
    return *code == 255 ? std::numeric_limits<float>::quiet_NaN() : pow2(127 - std::min(*code, 254));
  }
  if (r.rule == kRceil) {
    const float descale = amax / r.element_max;
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
  if (r.rule == kNvfp4) {
    // torchao's nvfp4_quantize: tensor scale amax / (448 * 6), block scale
    // (block_amax / 6) / tensor_scale clamped to [2**-6, 448] and cast to E4M3 (c10's
    // cast, torch's own), elements times (1 / tensor_scale) / block_scale. NaNs (and
    // their signs: x86's 0/0 is -NaN, E4M3 0xFF) follow from the same fp32 operations.
    const float e4m3_max = 448.0f, smallest = 0.015625f;  // E4M3's largest, smallest normal
    const float tensor_scale = bits_to_float(r.tensor_amax_bits) / (e4m3_max * r.element_max);
    const float scaled = (amax / r.element_max) / tensor_scale;
    *out_of_range = finite_nonzero && (scaled < smallest || scaled > e4m3_max);
    const float clamped = std::isnan(scaled) ? scaled : std::min(std::max(scaled, smallest), e4m3_max);
    const c10::Float8_e4m3fn scale(clamped);
    *code = int(scale.x);
    return (1.0f / tensor_scale) / float(scale);
  }
  // kPow2Floor (and amax-pow2) / kAmax: elem_max / amax in fp32, overflow clamped;
  // pow2 rounds it down to a power of two
  float multiplier = r.element_max / amax;
  *out_of_range = finite_nonzero && std::isinf(multiplier);
  if (std::isinf(multiplier)) multiplier = std::numeric_limits<float>::max();
  if (amax == 0.0f) multiplier = 1.0f;
  if (r.rule == kPow2Floor) multiplier = bits_to_float(float_bits(multiplier) & ~0x7FFFFFu);
  const uint32_t bits = float_bits(multiplier);
  const int biased = int(bits >> 23 & 0xFF);
  *code = nan ? 255 : std::min(std::max(2 * 127 - biased - int((bits & 0x7FFFFFu) > 0), 0), 254);
  return nan ? std::numeric_limits<float>::quiet_NaN() : multiplier;
}

// floor(log2(top / bottom)) of two finite positive fp32 bit patterns, exactly: with
// x = (1 + f / 2**23) * 2**(e - 127) (subnormals normalised), it is
// e_top - e_bottom - (f_top < f_bottom).
__attribute__((always_inline)) inline int log2_ratio(uint32_t top, uint32_t bottom) {
  auto split = [](uint32_t u, int* exponent, uint32_t* fraction) {
    const int biased = int(u >> 23);
    if (biased != 0) {
      *exponent = biased;
      *fraction = u & 0x7FFFFFu;
    } else {  // subnormal: u * 2**-149, its top bit at 2**(p - 149)
      const int p = 31 - __builtin_clz(u);
      *exponent = p - 22;
      *fraction = (u << (23 - p)) & 0x7FFFFFu;
    }
  };
  int top_exponent, bottom_exponent;
  uint32_t top_fraction, bottom_fraction;
  split(top, &top_exponent, &top_fraction);
  split(bottom, &bottom_exponent, &bottom_fraction);
  return top_exponent - bottom_exponent - int(top_fraction < bottom_fraction);
}

inline v8i load(const uint32_t* p) {
  v8i v;
  std::memcpy(&v, p, sizeof v);
  return v & 0x7FFFFFFF;
}

// The largest and smallest of 8 lanes by shuffles: a per-lane scalar loop extracts each
// lane, which cost more than the block's own loads once per (32-value) block.
__attribute__((always_inline)) inline int32_t lanes_max(v8i v) {
  v8i s = __builtin_shuffle(v, v8i{4, 5, 6, 7, 0, 1, 2, 3});
  v = v > s ? v : s;
  s = __builtin_shuffle(v, v8i{2, 3, 0, 1, 6, 7, 4, 5});
  v = v > s ? v : s;
  s = __builtin_shuffle(v, v8i{1, 0, 3, 2, 5, 4, 7, 6});
  v = v > s ? v : s;
  return v[0];
}

__attribute__((always_inline)) inline int32_t lanes_min(v8i v) {
  v8i s = __builtin_shuffle(v, v8i{4, 5, 6, 7, 0, 1, 2, 3});
  v = v < s ? v : s;
  s = __builtin_shuffle(v, v8i{2, 3, 0, 1, 6, 7, 4, 5});
  v = v < s ? v : s;
  s = __builtin_shuffle(v, v8i{1, 0, 3, 2, 5, 4, 7, 6});
  v = v < s ? v : s;
  return v[0];
}

struct Extremes {
  int32_t amax = 0;          // largest |x| bits (NaN above inf, as torch's amax)
  int32_t top = 0;           // largest finite nonzero |x| bits
  int32_t bottom = kNoValue;  // smallest finite nonzero |x| bits
  void merge(const Extremes& o) {
    amax = std::max(amax, o.amax);
    top = std::max(top, o.top);
    bottom = std::min(bottom, o.bottom);
  }
};

// Vectorised: the largest |x| and the smallest of (|x| bits - 1) mod 2**31, which sends 0
// to the top and keeps inf and NaN above every finite value; with no inf or NaN in the
// block, that is its smallest nonzero value and its largest is the amax. A block holding
// inf or NaN (rare) is read again, exactly.
__attribute__((always_inline)) inline Extremes extremes(const uint32_t* p, int64_t count) {
  v8i amax = {}, below = v8i{} + kNoValue;
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const v8i u = load(p + j);
    amax = u > amax ? u : amax;
    const v8i b = (u - 1) & 0x7FFFFFFF;
    below = b < below ? b : below;
  }
  Extremes e;
  e.amax = lanes_max(amax);
  int32_t smallest = lanes_min(below);  // of (bits - 1) mod 2**31
  for (; j < count; ++j) {
    const int32_t u = int32_t(p[j] & 0x7FFFFFFFu);
    e.amax = std::max(e.amax, u);
    smallest = std::min(smallest, (u - 1) & 0x7FFFFFFF);
  }
  if (__builtin_expect(e.amax < int32_t(kInfBits), 1)) {
    if (smallest < int32_t(kInfBits) - 1) {  // a finite nonzero value
      e.top = e.amax;
      e.bottom = smallest + 1;
    }
    return e;
  }
  for (int64_t i = 0; i < count; ++i) {
    const int32_t u = int32_t(p[i] & 0x7FFFFFFFu);
    if (u != 0 && u < int32_t(kInfBits)) {
      e.top = std::max(e.top, u);
      e.bottom = std::min(e.bottom, u);
    }
  }
  return e;
}

struct Thresholds {
  float zero_edge, below_normal, overflow_edge;
  bool inclusive;  // a value at the overflow edge saturates (else it rounds down)
};

// Per-lane threshold counts (as -1 masks subtracted), summed over many blocks before one
// horizontal sum: zero, nonfinite, scaled <= the round-to-zero edge (zeros included),
// scaled below the normal range (zeros and flushed included), saturated. Under a finite
// multiplier m >= 0 a non-finite value scales to inf or NaN, which is below neither edge,
// so the classes are differences of these counts (add_lanes).
struct Lanes {
  static constexpr int kKinds = 5;
  v8i c[kKinds] = {};
  int64_t tail[kKinds] = {};
  int64_t since_flush = 0;
  int64_t values = 0;
  int64_t wide[kKinds] = {};
  void flush() {
    for (int i = 0; i < kKinds; ++i) {
      for (int l = 0; l < kLanes; ++l) wide[i] -= c[i][l];
      wide[i] += tail[i];
      c[i] = v8i{};
      tail[i] = 0;
    }
    since_flush = 0;
  }
};

// Classifies `count` values scaled by the finite multiplier m into `lanes`. `Inclusive`:
// a value at the overflow edge saturates.
template <bool Inclusive>
__attribute__((always_inline)) inline void classify(const uint32_t* p, int64_t count, float m,
                                                    const Thresholds& t, Lanes& lanes) {
  const v8f ze = v8f{} + t.zero_edge, bn = v8f{} + t.below_normal, oe = v8f{} + t.overflow_edge;
  const v8f mv = v8f{} + m;
  v8i zero = lanes.c[0], nonfinite = lanes.c[1], below_edge = lanes.c[2],
      below_normal = lanes.c[3], saturated = lanes.c[4];
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const v8i u = load(p + j);
    const v8i is_nonfinite = u >= int32_t(kInfBits);
    v8f value;
    std::memcpy(&value, &u, sizeof value);
    const v8f s = value * mv;
    zero += u == 0;
    nonfinite += is_nonfinite;
    below_edge += s <= ze;
    below_normal += s < bn;
    saturated += (Inclusive ? s >= oe : s > oe) & ~is_nonfinite;
  }
  lanes.c[0] = zero, lanes.c[1] = nonfinite, lanes.c[2] = below_edge;
  lanes.c[3] = below_normal, lanes.c[4] = saturated;
  for (; j < count; ++j) {
    const uint32_t u = p[j] & 0x7FFFFFFFu;
    const float s = bits_to_float(u) * m;
    lanes.tail[0] += u == 0;
    lanes.tail[1] += u >= kInfBits;
    lanes.tail[2] += s <= t.zero_edge;
    lanes.tail[3] += s < t.below_normal;
    lanes.tail[4] += u < kInfBits && (Inclusive ? s >= t.overflow_edge : s > t.overflow_edge);
  }
  lanes.values += count;
  lanes.since_flush += count;
  if (lanes.since_flush >= kLaneFlush) lanes.flush();
}

__attribute__((always_inline)) inline void classify(const uint32_t* p, int64_t count, float m,
                                                    const Thresholds& t, Lanes& lanes) {
  if (t.inclusive) {
    classify<true>(p, count, m, t, lanes);
  } else {
    classify<false>(p, count, m, t, lanes);
  }
}

// A block whose multiplier is not finite: its finite nonzero values are poisoned.
__attribute__((always_inline)) inline void count_poisoned(const uint32_t* p, int64_t count, int64_t* local) {
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t u = p[j] & 0x7FFFFFFFu;
    local[0] += u == 0;
    local[5] += u >= kInfBits;
    local[6] += u != 0 && u < kInfBits;
  }
}

// The scale, the flushed-block count and the dynamic range of one block from its
// extremes; the class counts are the caller's. Returns the multiplier.
__attribute__((always_inline)) inline float add_block(const Rule& r, const Extremes& e, float zero_edge, int64_t* local) {
  int code;
  bool out_of_range;
  const float m = block_scale(r, uint32_t(e.amax), &code, &out_of_range);
  ++local[kCounts + code];
  local[9] += int64_t(out_of_range);
  if (e.bottom != kNoValue) {
    // fp32 products by m >= 0 are monotonic: the block flushes a value iff its smallest does
    local[8] += int64_t(std::isfinite(m) && bits_to_float(uint32_t(e.bottom)) * m <= zero_edge);
    ++local[kCounts + kCodes + log2_ratio(uint32_t(e.top), uint32_t(e.bottom))];
  }
  return m;
}

__attribute__((always_inline)) inline void add_lanes(Lanes& lanes, int64_t* local) {
  lanes.flush();
  const int64_t* w = lanes.wide;  // zero, nonfinite, <= zero edge, < normal, saturated
  const int64_t flushed = w[2] - w[0], subnormal = w[3] - w[2];
  const int64_t live = lanes.values - w[0] - w[1];
  local[0] += w[0];
  local[1] += flushed;
  local[2] += subnormal;
  local[3] += live - flushed - subnormal - w[4];
  local[4] += w[4];
  local[5] += w[1];
}

// Every block of rows [begin, end): its extremes, its scale, its values' classes.
__attribute__((target_clones("avx2", "default")))
void block_rows(const uint32_t* data, int64_t k, int64_t begin, int64_t end, const Rule& r,
                const Thresholds& t, int64_t* local) {
  Lanes lanes;
  for (int64_t b = begin; b < end; ++b) {
    const uint32_t* row = data + b * k;
    const float m = add_block(r, extremes(row, k), t.zero_edge, local);
    if (__builtin_expect(std::isfinite(m), 1)) {
      classify(row, k, m, t, lanes);
    } else {
      count_poisoned(row, k, local);
    }
  }
  add_lanes(lanes, local);
}

__attribute__((target_clones("avx2", "default")))
Extremes span_extremes(const uint32_t* data, int64_t begin, int64_t end) {
  Extremes e;
  for (int64_t start = begin; start < end; start += kLaneFlush) {
    e.merge(extremes(data + start, std::min(end - start, kLaneFlush)));
  }
  return e;
}

__attribute__((target_clones("avx2", "default")))
void span_classify(const uint32_t* data, int64_t begin, int64_t end, float m,
                   const Thresholds& t, int64_t* local) {
  Lanes lanes;
  for (int64_t start = begin; start < end; start += kLaneFlush) {
    classify(data + start, std::min(end - start, kLaneFlush), m, t, lanes);
  }
  add_lanes(lanes, local);
}

constexpr int64_t kSpanGrain = int64_t(1) << 16;

// The extremes of all values, in parallel.
Extremes all_extremes(const uint32_t* data, int64_t count) {
  Extremes total;
  std::mutex merge;
  at::parallel_for(0, count, kSpanGrain, [&](int64_t begin, int64_t end) {
    const Extremes e = span_extremes(data, begin, end);
    std::lock_guard<std::mutex> guard(merge);
    total.merge(e);
  });
  return total;
}

}  // namespace

// Adds the whole statistics vector of blockstats (layout: 10 counts, 256 scale codes, 277
// ranges) of `blocks` (contiguous fp32 [n, k], one block per row) under `rule` (0
// mx-floor, 1 mx-rceil, 2 pow2-floor and amax-pow2, 3 nvfp4, 4 amax) to `out` (a
// contiguous int64 CPU vector of that width: a recorder's running total, so no output
// is allocated per call). `padding` zeros are not counted. One pass over the values
// where a block's scale depends on it alone; nvfp4 and a single block (the per-tensor
// rules) first find the tensor's maximum in a pass of their own. A single block is
// split across threads.
void block_stats_add(const torch::Tensor& blocks, int64_t rule, double element_max,
                     int64_t element_max_pow2, double zero_edge, double below_normal,
                     double overflow_edge, bool inclusive, int64_t padding, torch::Tensor& out) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kFloat32 &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "block_stats needs a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kInt64 && out.dim() == 1 &&
                  out.size(0) == kWidth && out.is_contiguous(),
              "block_stats_add needs a contiguous int64 CPU vector of ", kWidth, " counts");
  TORCH_CHECK(rule >= kFloor && rule <= kAmax, "unknown rule ", rule);
  const int64_t n = blocks.size(0), k = blocks.size(1);
  const auto* data = reinterpret_cast<const uint32_t*>(blocks.data_ptr<float>());
  const Thresholds t{float(zero_edge), float(below_normal), float(overflow_edge), inclusive};
  Rule r{int(rule), float(element_max), int(element_max_pow2), 0};
  int64_t* total = out.data_ptr<int64_t>();
  std::mutex merge;
  if (n == 1) {
    const Extremes e = all_extremes(data, k);
    r.tensor_amax_bits = uint32_t(e.amax);
    const float m = add_block(r, e, t.zero_edge, total);
    if (std::isfinite(m)) {
      at::parallel_for(0, k, kSpanGrain, [&](int64_t begin, int64_t end) {
        std::array<int64_t, kCounts> local{};
        span_classify(data, begin, end, m, t, local.data());
        std::lock_guard<std::mutex> guard(merge);
        for (int i = 0; i < kCounts; ++i) total[i] += local[i];
      });
    } else {
      count_poisoned(data, k, total);
    }
  } else {
    if (rule == kNvfp4) r.tensor_amax_bits = uint32_t(all_extremes(data, n * k).amax);
    const int64_t grain = std::max<int64_t>(1, kSpanGrain / std::max<int64_t>(k, 1));
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      std::array<int64_t, kWidth> local{};
      block_rows(data, k, begin, end, r, t, local.data());
      std::lock_guard<std::mutex> guard(merge);
      for (int i = 0; i < kWidth; ++i) total[i] += local[i];
    });
  }
  total[0] -= padding;
  total[7] += n;
}

// The statistics vector of `blocks` alone (see block_stats_add).
torch::Tensor block_stats(const torch::Tensor& blocks, int64_t rule, double element_max,
                          int64_t element_max_pow2, double zero_edge, double below_normal,
                          double overflow_edge, bool inclusive, int64_t padding) {
  auto out = torch::zeros({kWidth}, blocks.options().dtype(torch::kInt64));
  block_stats_add(blocks, rule, element_max, element_max_pow2, zero_edge, below_normal,
                  overflow_edge, inclusive, padding, out);
  return out;
}

// A zeroed int64 table [rows, width] for HistogramTable, in memory the kernel may back
// with 2 MB pages (Linux's transparent huge pages, where they are on "madvise"): a step
// reads and writes rows 17 KB apart all over a table of many MB, and with 4 KB pages
// nearly every row cost a TLB miss. Small tables, and systems without the hint, get
// torch.zeros.
torch::Tensor histogram_table(int64_t rows, int64_t width) {
  TORCH_CHECK(rows >= 0 && width > kBins, "a table needs rows >= 0 and more than ", kBins, " columns");
  const size_t bytes = size_t(rows) * size_t(width) * sizeof(int64_t);
  constexpr size_t kHuge = size_t(2) << 20;
#ifdef MADV_HUGEPAGE
  if (bytes >= 2 * kHuge) {
    const size_t mapped = bytes + kHuge;  // room to start on a 2 MB boundary
    void* start = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (start != MAP_FAILED) {  // anonymous pages read as zero
      const uintptr_t at = (reinterpret_cast<uintptr_t>(start) + kHuge - 1) & ~(kHuge - 1);
      void* aligned = reinterpret_cast<void*>(at);
      madvise(aligned, bytes, MADV_HUGEPAGE);  // a hint: nothing changes where it is refused
      return torch::from_blob(
          aligned, {rows, width}, [start, mapped](void*) { munmap(start, mapped); },
          torch::TensorOptions().dtype(torch::kInt64));
    }
  }
#endif
  return torch::zeros({rows, width}, torch::kInt64);
}

namespace {
// histogram_add_tensor(x, table, row, spans) as a plain CPython function (METH_FASTCALL):
// the per-op call of the dispatch mode. pybind11's argument casters (the optional spans
// most of all) cost more than binning a small tensor; this unpacks the four arguments
// itself. Errors are the same TORCH_CHECK messages, as RuntimeError.
PyObject* histogram_add_fast(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !THPVariable_Check(args[0]) || !THPVariable_Check(args[1]) ||
      !PyLong_Check(args[2]) || !THPVariable_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "histogram_add_fast(x, table, row, spans): tensors and an int");
    return nullptr;
  }
  const long long row = PyLong_AsLongLong(args[2]);
  if (row == -1 && PyErr_Occurred()) return nullptr;
  try {
    torch::Tensor table = THPVariable_Unpack(args[1]);
    histogram_add_tensor(THPVariable_Unpack(args[0]), table, row, THPVariable_Unpack(args[3]));
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef histogram_add_fast_def = {
    "histogram_add_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(histogram_add_fast)),
    METH_FASTCALL, "histogram_add_tensor(x, table, row, spans), without pybind11's casters"};
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_spans = py::arg("spans") = py::none();
  m.def("histogram_add", &histogram_add, "Exact fp32 magnitude histogram (fpaudit layout)",
        py::arg("x"), py::arg("table"), py::arg("row"), py::arg("class_bounds"), no_spans);
  m.def("set_vector_split", &set_vector_split,
        "Whether large fp32 tensors' first pass may use AVX-512 (returns the previous setting)");
  m.def("set_class_bounds", &set_class_bounds, "The class bounds histogram_add_tensor uses");
  m.def("histogram_add_tensor", &histogram_add_tensor, "histogram_add of any strided fp32/16/8 tensor",
        py::arg("x"), py::arg("table"), py::arg("row"), no_spans);
  m.add_object("histogram_add_fast",
               py::reinterpret_steal<py::object>(PyCFunction_New(&histogram_add_fast_def, nullptr)));
  m.def("histogram_table", &histogram_table, "A zeroed table, in huge pages where the system has them",
        py::arg("rows"), py::arg("width"));
  m.def("histogram_add_many", &histogram_add_many, "histogram_add of many tensors, one row each",
        py::arg("xs"), py::arg("table"), py::arg("rows"), py::arg("class_bounds"), no_spans);
  m.def("histogram_add_planned", &histogram_add_planned,
        "A step's planned gradients, one call: (rows added to, indices left to the caller)",
        py::arg("grads"), py::arg("table"), py::arg("rows"), py::arg("dtypes"), no_spans,
        py::arg("of_params") = false);
  m.def("histogram_nonzero", &histogram_nonzero,
        "The rows' nonzero finite bins, row-major; each row's finite sum and edge columns",
        py::arg("table"), py::arg("rows"), no_spans, py::arg("clear") = false);
  m.def("histogram_clear", &histogram_clear, "Zero the rows, writing only nonzero entries",
        py::arg("table"), py::arg("rows"), no_spans);
  m.def("block_stats", &block_stats, "Block-scaled statistics of every recipe's scale rule");
  m.def("block_stats_add", &block_stats_add, "block_stats, added to a running total in place");
}
