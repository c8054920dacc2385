// SPDX-License-Identifier: Apache-2.0
// Statistics shared by the lossless-sampling tests: an independent reference of the sampling warp
// and Pearson's chi-square test.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <vector>

namespace stats {

// Independent reference of the warp (double, libm, full sort): T, top-k, then top-p.
inline std::vector<double> reference_warp(const float* z, int vocab, double temperature, int top_k, double top_p) {
  std::vector<int> order(static_cast<std::size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
  std::vector<double> q(static_cast<std::size_t>(vocab), 0.0);
  const double m = z[order[0]];
  const int keep = top_k > 0 && top_k < vocab ? top_k : vocab;
  double s = 0.0;
  for (int i = 0; i < keep; ++i) {
    const auto x = static_cast<std::size_t>(order[static_cast<std::size_t>(i)]);
    s += q[x] = std::exp((z[x] - m) / temperature);
  }
  for (auto& v : q) v /= s;
  double above = 0.0, kept = 0.0;
  std::vector<double> out(q.size(), 0.0);
  for (int i = 0; i < keep; ++i) {
    const auto x = static_cast<std::size_t>(order[static_cast<std::size_t>(i)]);
    if (above <= top_p) {
      out[x] = q[x];
      kept += q[x];
    }
    above += q[x];
  }
  for (auto& v : out) v /= kept;
  return out;
}

// Upper tail of chi-square with k degrees of freedom (Wilson–Hilferty normal approximation).
inline double chi2_survival(double x, int k) {
  const double kk = k;
  const double z = (std::cbrt(x / kk) - (1.0 - 2.0 / (9.0 * kk))) / std::sqrt(2.0 / (9.0 * kk));
  return 0.5 * std::erfc(z / std::sqrt(2.0));
}

struct chi2_result {
  double stat = 0.0;
  int dof = 0;
  double p = 1.0;
  bool impossible = false;  // an observation in a cell of probability 0
};

// Pearson chi-square over cells, pooling cells expected below 5.
inline chi2_result chi2_test(const std::vector<double>& expected_prob, const std::vector<long>& observed, long n) {
  chi2_result r;
  double pool_e = 0.0, pool_o = 0.0;
  int cells = 0;
  for (std::size_t i = 0; i < expected_prob.size(); ++i) {
    const double e = expected_prob[i] * static_cast<double>(n);
    if (expected_prob[i] == 0.0) {
      r.impossible = r.impossible || observed[i] != 0;
      continue;
    }
    if (e < 5.0) {
      pool_e += e;
      pool_o += static_cast<double>(observed[i]);
      continue;
    }
    r.stat += (static_cast<double>(observed[i]) - e) * (static_cast<double>(observed[i]) - e) / e;
    ++cells;
  }
  if (pool_e > 0.0) {
    r.stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
    ++cells;
  }
  r.dof = cells - 1;
  r.p = cells > 1 ? chi2_survival(r.stat, cells - 1) : 1.0;
  if (r.impossible) r.p = 0.0;
  return r;
}

}  // namespace stats
