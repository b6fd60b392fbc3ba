// Prometheus metrics in the text exposition format (version 0.0.4), for th-server and libthclient.
//
// No registry and no global state: whoever owns the figures renders them when scraped, family by
// family, into a MetricsText. So a scrape reads the Hub's own counters as they are (nothing is
// kept twice), and the label sets are whatever the renderer chooses to write (bounded by what it
// iterates: op kinds, datacenters, models). Histograms are the one kind of figure that must be
// accumulated as events happen; Histogram is that accumulator.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace th::net {

using MetricLabels = std::initializer_list<std::pair<std::string_view, std::string_view>>;

// Counts observations into fixed buckets (upper bounds, ascending); the +Inf bucket is implicit.
class Histogram {
 public:
  explicit Histogram(std::span<const double> upper_bounds);
  void observe(double value);
  // Adds every observation of `other`, which must have the same bounds.
  void merge(const Histogram& other);

  std::span<const double> upper_bounds() const { return upper_bounds_; }
  // Observations <= upper_bounds()[i], not cumulative; the last element counts those above all.
  std::span<const std::uint64_t> bucket_counts() const { return counts_; }
  std::uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> upper_bounds_;
  std::vector<std::uint64_t> counts_;  // upper_bounds_.size() + 1
  std::uint64_t count_ = 0;
  double sum_ = 0;
};

// Bucket bounds for durations: 50 us .. 10 min, roughly x2.5 apart (server operations run from
// tens of microseconds to a replicate that waits minutes for its version).
std::span<const double> latency_buckets_seconds();

// The exposition text of one scrape. Families are declared once, then their samples follow; a
// family's samples must not be interleaved with another's (TH_REQUIRE'd).
class MetricsText {
 public:
  enum class Type : std::uint8_t { kCounter, kGauge, kHistogram };
  // Starts a family: # HELP and # TYPE lines. `name` follows Prometheus' rules (counters end in
  // _total, units last: _seconds, _bytes).
  void family(std::string_view name, Type type, std::string_view help);
  // A sample of the current family (a counter's or gauge's value).
  void sample(MetricLabels labels, double value);
  // The _bucket, _sum and _count samples of the current histogram family.
  void histogram(MetricLabels labels, const Histogram& histogram);
  // Same, with extra labels held at run time (e.g. a client's model and replica).
  void sample(const std::vector<std::pair<std::string, std::string>>& labels, double value);
  void histogram(const std::vector<std::pair<std::string, std::string>>& labels, const Histogram& histogram);

  const std::string& text() const { return text_; }
  std::string take() { return std::move(text_); }

 private:
  void write_sample(std::string_view suffix, std::span<const std::pair<std::string_view, std::string_view>> labels,
                    std::string_view extra_label, std::string_view extra_value, double value);
  void write_histogram(std::span<const std::pair<std::string_view, std::string_view>> labels,
                       const Histogram& histogram);
  std::string text_;
  std::string current_;  // the family being written
  Type current_type_ = Type::kCounter;
  std::vector<std::string> families_;  // every family written, to refuse a second declaration
};

// Whether `name` is a valid metric or label name ([a-zA-Z_:][a-zA-Z0-9_:]*; labels without ':').
bool valid_metric_name(std::string_view name);

}  // namespace th::net
