#include "net/metrics.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>

#include "core/assert.h"

namespace th::net {

namespace {

constexpr std::array<double, 18> kLatencyBucketsSeconds = {
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
    50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    10.0, 60.0,  600.0};

void append_number(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "NaN";
    return;
  }
  if (std::isinf(value)) {
    out += value > 0 ? "+Inf" : "-Inf";
    return;
  }
  char buffer[32];
  // Integers (every counter) print as such; others with the shortest text that reads back exact.
  const bool integral = std::abs(value) < 9.0e15 && value == std::floor(value);
  const auto written = integral ? std::to_chars(buffer, buffer + sizeof buffer, static_cast<std::int64_t>(value))
                                : std::to_chars(buffer, buffer + sizeof buffer, value);
  TH_ASSERT(written.ec == std::errc{}, "a number fits 32 characters");
  out.append(buffer, written.ptr);
}

// Label values may hold anything a user named (a replica, a datacenter): \, " and newline are
// escaped, as the format requires.
void append_label_value(std::string& out, std::string_view value) {
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
}

using LabelViews = std::vector<std::pair<std::string_view, std::string_view>>;

LabelViews views_of(const std::vector<std::pair<std::string, std::string>>& labels) {
  LabelViews views;
  views.reserve(labels.size());
  for (const auto& [name, value] : labels) views.emplace_back(name, value);
  return views;
}

}  // namespace

bool valid_metric_name(std::string_view name) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    const bool digit = c >= '0' && c <= '9';
    if (!letter && !(digit && i > 0)) return false;
  }
  return true;
}

Histogram::Histogram(std::span<const double> upper_bounds)
    : upper_bounds_(upper_bounds.begin(), upper_bounds.end()), counts_(upper_bounds.size() + 1, 0) {
  TH_REQUIRE(std::is_sorted(upper_bounds_.begin(), upper_bounds_.end()), "histogram bounds ascend");
}

void Histogram::observe(double value) {
  const auto bucket = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  ++counts_[static_cast<std::size_t>(bucket)];
  ++count_;
  sum_ += value;
}

void Histogram::merge(const Histogram& other) {
  TH_REQUIRE(other.upper_bounds_ == upper_bounds_, "merged histograms have the same buckets");
  for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  count_ += other.count_;
  sum_ += other.sum_;
}

std::span<const double> latency_buckets_seconds() { return kLatencyBucketsSeconds; }

void MetricsText::family(std::string_view name, Type type, std::string_view help) {
  TH_REQUIRE(valid_metric_name(name), "a metric name is [a-zA-Z_:][a-zA-Z0-9_:]*");
  TH_REQUIRE(std::find(families_.begin(), families_.end(), name) == families_.end(),
             "a metric family is declared once per scrape");
  TH_REQUIRE(help.find('\n') == std::string_view::npos, "help is one line");
  families_.emplace_back(name);
  current_ = name;
  current_type_ = type;
  text_ += "# HELP ";
  text_ += name;
  text_ += ' ';
  text_ += help;
  text_ += "\n# TYPE ";
  text_ += name;
  text_ += type == Type::kCounter ? " counter\n" : type == Type::kGauge ? " gauge\n" : " histogram\n";
}

void MetricsText::write_sample(std::string_view suffix,
                               std::span<const std::pair<std::string_view, std::string_view>> labels,
                               std::string_view extra_label, std::string_view extra_value, double value) {
  TH_REQUIRE(!current_.empty(), "a sample follows its family");
  text_ += current_;
  text_ += suffix;
  if (!labels.empty() || !extra_label.empty()) {
    text_ += '{';
    bool first = true;
    auto label = [&](std::string_view name, std::string_view label_value) {
      TH_REQUIRE(valid_metric_name(name) && name.find(':') == std::string_view::npos, "a label name is valid");
      if (!first) text_ += ',';
      first = false;
      text_ += name;
      text_ += "=\"";
      append_label_value(text_, label_value);
      text_ += '"';
    };
    for (const auto& [name, label_value] : labels) label(name, label_value);
    if (!extra_label.empty()) label(extra_label, extra_value);
    text_ += '}';
  }
  text_ += ' ';
  append_number(text_, value);
  text_ += '\n';
}

void MetricsText::sample(MetricLabels labels, double value) {
  TH_REQUIRE(current_type_ != Type::kHistogram, "a histogram's samples come from histogram()");
  write_sample("", std::span(labels.begin(), labels.size()), "", "", value);
}

void MetricsText::sample(const std::vector<std::pair<std::string, std::string>>& labels, double value) {
  TH_REQUIRE(current_type_ != Type::kHistogram, "a histogram's samples come from histogram()");
  const LabelViews views = views_of(labels);
  write_sample("", views, "", "", value);
}

void MetricsText::write_histogram(std::span<const std::pair<std::string_view, std::string_view>> labels,
                                  const Histogram& histogram) {
  TH_REQUIRE(current_type_ == Type::kHistogram, "histogram() writes a histogram family");
  std::uint64_t cumulative = 0;
  std::string bound;
  for (std::size_t i = 0; i < histogram.upper_bounds().size(); ++i) {
    cumulative += histogram.bucket_counts()[i];
    bound.clear();
    append_number(bound, histogram.upper_bounds()[i]);
    write_sample("_bucket", labels, "le", bound, static_cast<double>(cumulative));
  }
  write_sample("_bucket", labels, "le", "+Inf", static_cast<double>(histogram.count()));
  write_sample("_sum", labels, "", "", histogram.sum());
  write_sample("_count", labels, "", "", static_cast<double>(histogram.count()));
}

void MetricsText::histogram(MetricLabels labels, const Histogram& histogram) {
  write_histogram(std::span(labels.begin(), labels.size()), histogram);
}

void MetricsText::histogram(const std::vector<std::pair<std::string, std::string>>& labels,
                            const Histogram& histogram) {
  const LabelViews views = views_of(labels);
  write_histogram(views, histogram);
}

}  // namespace th::net
