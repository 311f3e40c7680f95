// Python bindings of the native hot paths (module dyn_plugin._core).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>
#include <stdexcept>

#include <algorithm>

#include "cost_table.hpp"
#include "dispatch.hpp"
#include "knapsack.hpp"
#include "microbatch.hpp"
#include "simulator.hpp"

namespace py = pybind11;
using dyn::CostTable;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;

CostTable make_table(Doubles coef, bool packed, int64_t pad_multiple, double max_tokens, double max_len,
                     std::optional<Doubles> bands) {
  if (coef.ndim() != 3 || coef.shape(0) != dyn::kNumComponents || coef.shape(1) != dyn::kNumMetrics ||
      coef.shape(2) != 4)
    throw std::invalid_argument("coef must have shape [3 components, 4 metrics, 4 (c0, c1, c2, floor)]");
  if (pad_multiple < 1) throw std::invalid_argument("pad_multiple must be >= 1");
  CostTable t;
  auto c = coef.unchecked<3>();
  for (int i = 0; i < dyn::kNumComponents; ++i)
    for (int j = 0; j < dyn::kNumMetrics; ++j)
      for (int k = 0; k < 4; ++k) t.coef[i][j][k] = c(i, j, k);
  if (bands) {
    // [component, metric, rows, 4]; rows with upper length -inf fill a fit's shorter list and never apply
    if (bands->ndim() != 4 || bands->shape(0) != dyn::kNumComponents || bands->shape(1) != dyn::kNumMetrics ||
        bands->shape(3) != 4)
      throw std::invalid_argument("bands must have shape [3 components, 4 metrics, rows, 4 (upper, c0, c1, c2)]");
    auto b = bands->unchecked<4>();
    for (int i = 0; i < dyn::kNumComponents; ++i)
      for (int j = 0; j < dyn::kNumMetrics; ++j)
        for (py::ssize_t r = 0; r < b.shape(2); ++r)
          if (b(i, j, r, 0) > -std::numeric_limits<double>::infinity())
            t.bands[i][j].push_back({b(i, j, r, 0), b(i, j, r, 1), b(i, j, r, 2), b(i, j, r, 3)});
  }
  t.packed = packed;
  t.pad_multiple = pad_multiple;
  t.max_tokens = max_tokens;
  t.max_len = max_len;
  return t;
}

py::tuple to_tuple(const dyn::StageCost& r) {
  return py::make_tuple(r.forward_ms, r.backward_ms, r.stored_bytes, r.peak_bytes, r.extrapolated);
}

void check_sp(int64_t sp) {
  if (sp < 1 || (sp & (sp - 1))) throw std::invalid_argument("a sequence-parallel size must be a power of two");
}

dyn::Features checked_features(const CostTable& t, py::array_t<int64_t, py::array::c_style | py::array::forcecast> lens,
                               int64_t sp) {
  if (lens.ndim() != 1 || lens.shape(0) == 0) throw std::invalid_argument("seq_lens must be a non-empty 1-D array");
  check_sp(sp);
  const int64_t* p = lens.data();
  for (py::ssize_t i = 0; i < lens.shape(0); ++i)
    if (p[i] <= 0) throw std::invalid_argument("sequence lengths must be positive");
  return t.features(p, lens.shape(0), sp);
}

// (forward, backward, weight, stored, peak, deferred per stage; activation bytes; link bytes per link)
using MicroBatchRow = std::tuple<std::vector<double>, std::vector<double>, std::vector<double>, std::vector<double>,
                                 std::vector<double>, std::vector<double>, double, std::vector<double>>;

std::vector<dyn::StageOps> stage_ops(const std::vector<std::string>& kinds, const std::vector<std::vector<int64_t>>& mbs) {
  if (mbs.size() != kinds.size()) throw std::invalid_argument("kinds and mbs need one entry per stage");
  std::vector<dyn::StageOps> stages;
  for (size_t s = 0; s < kinds.size(); ++s) {
    if (mbs[s].size() != kinds[s].size()) throw std::invalid_argument("a stage's kinds and mbs differ in length");
    stages.push_back({kinds[s], mbs[s]});
  }
  return stages;
}

std::vector<dyn::SimMicroBatch> sim_micro_batches(const std::vector<MicroBatchRow>& rows, size_t stages) {
  std::vector<dyn::SimMicroBatch> out;
  out.reserve(rows.size());
  for (const auto& r : rows) {
    dyn::SimMicroBatch mb{std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
                          std::get<4>(r), std::get<5>(r), std::get<6>(r), std::get<7>(r)};
    const auto fits = [&](const std::vector<double>& v) { return v.size() == stages; };
    if (!fits(mb.fwd) || !fits(mb.bwd) || !fits(mb.stored) || !fits(mb.peak))
      throw std::invalid_argument("a micro-batch is priced for another number of stages");
    if ((!mb.weight.empty() && !fits(mb.weight)) || (!mb.deferred.empty() && !fits(mb.deferred)) ||
        (!mb.link_bytes.empty() && mb.link_bytes.size() + 1 != stages))
      throw std::invalid_argument("a micro-batch's split backward or links are priced for another number of stages");
    if (mb.deferred.empty()) mb.deferred.assign(stages, 0.0);
    out.push_back(std::move(mb));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "dyn-plugin native hot paths";
  py::class_<CostTable>(m, "CostTable")
      .def(py::init(&make_table), py::arg("coef"), py::arg("packed"), py::arg("pad_multiple"),
           py::arg("max_tokens"), py::arg("max_len"), py::arg("bands") = py::none())
      .def(
          "stage_cost",
          [](const CostTable& t, py::array_t<int64_t, py::array::c_style | py::array::forcecast> lens,
             int64_t num_layers, bool first, bool last, int64_t sp) {
            return to_tuple(t.stage_cost(checked_features(t, lens, sp), num_layers, first, last));
          },
          py::arg("seq_lens"), py::arg("num_layers"), py::arg("first"), py::arg("last"), py::arg("sp") = 1,
          "(forward_ms, backward_ms, stored_bytes, peak_bytes, extrapolated) of one micro-batch, per rank of a "
          "sequence-parallel group of sp (collectives not included)")
      .def(
          "stage_cost_many",
          [](const CostTable& t, py::array_t<int64_t, py::array::c_style | py::array::forcecast> lens,
             py::array_t<int64_t, py::array::c_style | py::array::forcecast> offsets, int64_t num_layers, bool first,
             bool last) {
            // Micro-batch i is lens[offsets[i]:offsets[i+1]]: one call for many queries.
            const int64_t* o = offsets.data();
            const py::ssize_t n = offsets.shape(0) - 1;
            py::array_t<double> out({static_cast<py::ssize_t>(n < 0 ? 0 : n), static_cast<py::ssize_t>(4)});
            auto w = out.mutable_unchecked<2>();
            for (py::ssize_t i = 0; i < n; ++i) {
              if (o[i + 1] <= o[i] || o[i + 1] > lens.shape(0)) throw std::invalid_argument("bad offsets");
              const auto r = t.stage_cost(t.features(lens.data() + o[i], o[i + 1] - o[i]), num_layers, first, last);
              w(i, 0) = r.forward_ms;
              w(i, 1) = r.backward_ms;
              w(i, 2) = r.stored_bytes;
              w(i, 3) = r.peak_bytes;
            }
            return out;
          },
          py::arg("seq_lens"), py::arg("offsets"), py::arg("num_layers"), py::arg("first"), py::arg("last"),
          "[n, 4] costs of the micro-batches lens[offsets[i]:offsets[i+1]]");

  m.def(
      "partition",
      [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> sorted_lens, const std::vector<CostTable*>& tables,
         const std::vector<std::tuple<int64_t, bool, bool>>& stages,
         const std::vector<std::tuple<double, int64_t>>& memory, int64_t dp, double thin, int64_t sp,
         const std::vector<dyn::LayerComm>& comm) {
        if (stages.size() != memory.size() || stages.empty())
          throw std::invalid_argument("need one memory entry per pipeline stage");
        if (dp < 1) throw std::invalid_argument("dp must be >= 1");
        check_sp(sp);
        if (!comm.empty() && comm.size() != tables.size())
          throw std::invalid_argument("comm needs one (fa, fb, ba, bb, ss, sa, t0, ts, ta) per table (recompute mode), or none");
        std::vector<int64_t> lens(sorted_lens.data(), sorted_lens.data() + sorted_lens.shape(0));
        std::vector<const CostTable*> ts(tables.begin(), tables.end());
        std::vector<dyn::StageShape> ss;
        for (const auto& s : stages) ss.push_back({std::get<0>(s), std::get<1>(s), std::get<2>(s)});
        std::vector<dyn::StageMemory> ms;
        for (const auto& mm : memory) ms.push_back({std::get<0>(mm), std::get<1>(mm)});
        dyn::PartitionResult r;
        {
          py::gil_scoped_release release;
          r = dyn::partition(lens, ts, ss, ms, dp, thin, sp, comm);
        }
        return py::make_tuple(r.ok, r.bounds, r.modes, r.t_max, r.objective, r.infeasible_at);
      },
      py::arg("sorted_lens"), py::arg("tables"), py::arg("stages"), py::arg("memory"), py::arg("dp"), py::arg("thin"),
      py::arg("sp") = 1, py::arg("comm") = std::vector<dyn::LayerComm>{},
      "DynaPipe partition DP: (ok, bounds, modes, t_max, objective, infeasible_at); runs priced per rank of a "
      "sequence-parallel group of sp, plus per layer the collectives and buffers comm[mode] = (fa, fb, ba, bb, "
      "stored per token, per pair, transient fixed, per token, per pair)");

  m.def(
      "simulate",
      [](const std::vector<std::string>& kinds, const std::vector<std::vector<int64_t>>& mbs,
         const std::vector<MicroBatchRow>& micro_batches, double gb_per_s, double latency_us, bool record) {
        const auto stages = stage_ops(kinds, mbs);
        const auto priced = sim_micro_batches(micro_batches, stages.size());
        dyn::SimOutput r;
        {
          py::gil_scoped_release release;
          r = dyn::simulate(stages, priced, dyn::Link{gb_per_s, latency_us}, record);
        }
        py::list events;
        for (const auto& e : r.events)
          events.append(py::make_tuple(e.stage, e.stream, std::string(1, e.kind), e.mb, e.start, e.end));
        return py::make_tuple(r.makespan, r.busy, r.peak, events);
      },
      py::arg("kinds"), py::arg("mbs"), py::arg("micro_batches"), py::arg("gb_per_s"), py::arg("latency_us"),
      py::arg("record"),
      "one replica's schedule simulated (plan/steps/simulator.py): kinds and mbs per stage, per micro-batch (forward, "
      "backward, weight, stored, peak, deferred, activation bytes, link bytes); (makespan, busy per stage, activation "
      "peak per stage, events (stage, stream 0 compute / 1 send-fwd / 2 send-bwd, kind, mb, start, end) when record)");

  m.def(
      "knapsack",
      [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> weights,
         py::array_t<double, py::array::c_style | py::array::forcecast> times,
         py::array_t<uint8_t, py::array::c_style | py::array::forcecast> opens,
         py::array_t<int64_t, py::array::c_style | py::array::forcecast> reserve, int64_t capacity) {
        if (weights.ndim() != 2 || times.ndim() != 2 || opens.ndim() != 2 || reserve.ndim() != 1)
          throw std::invalid_argument("weights, times, opens must be [items, choices] and reserve [items]");
        const int64_t items = weights.shape(0), choices = weights.shape(1);
        if (times.shape(0) != items || times.shape(1) != choices || opens.shape(0) != items ||
            opens.shape(1) != choices || reserve.shape(0) != items)
          throw std::invalid_argument("weights, times, opens and reserve disagree on the number of items or choices");
        if (capacity < 0) throw std::invalid_argument("capacity must be >= 0");
        const int64_t* r = reserve.data();
        for (int64_t i = 0; i < items; ++i) {
          if (r[i] < 0) throw std::invalid_argument("reserve must be >= 0");
          if (i && r[i] > r[i - 1]) throw std::invalid_argument("items must come in descending reserve order");
        }
        const int64_t* w = weights.data();
        for (int64_t k = 0; k < items * choices; ++k)
          if (w[k] < 0) throw std::invalid_argument("weights must be >= 0");
        std::vector<int64_t> wv(w, w + items * choices), rv(r, r + items);
        std::vector<double> tv(times.data(), times.data() + items * choices);
        std::vector<uint8_t> ov(opens.data(), opens.data() + items * choices);
        dyn::KnapsackResult res;
        {
          py::gil_scoped_release release;
          res = dyn::knapsack(wv, tv, ov, rv, items, choices, capacity);
        }
        py::array_t<double> frontier(static_cast<py::ssize_t>(res.frontier.size()));
        std::copy(res.frontier.begin(), res.frontier.end(), frontier.mutable_data());
        return py::make_tuple(res.ok, res.choice, res.weight, frontier);
      },
      py::arg("weights"), py::arg("times"), py::arg("opens"), py::arg("reserve"), py::arg("capacity"),
      "multiple-choice knapsack with a shared reserve (plan/sharding/knapsack.py): (ok, choice per item, units used, "
      "frontier[capacity + 1]); items in descending reserve order");

  m.def(
      "dispatch",
      [](py::array_t<double, py::array::c_style | py::array::forcecast> times,
         py::array_t<int64_t, py::array::c_style | py::array::forcecast> kinds,
         py::array_t<double, py::array::c_style | py::array::forcecast> fill,
         py::array_t<int64_t, py::array::c_style | py::array::forcecast> order, int64_t rounds) {
        if (times.ndim() != 2 || kinds.ndim() != 1 || fill.ndim() != 1 || order.ndim() != 1)
          throw std::invalid_argument("times must be [kinds, sequences], kinds [pipelines], fill [kinds], order [n]");
        const int64_t K = times.shape(0), n = times.shape(1);
        if (fill.shape(0) != K || order.shape(0) != n)
          throw std::invalid_argument("fill needs one entry per row of times and order one per sequence");
        const int64_t* k = kinds.data();
        for (py::ssize_t p = 0; p < kinds.shape(0); ++p)
          if (k[p] < 0 || k[p] >= K) throw std::invalid_argument("a pipeline's kind is not a row of times");
        std::vector<int64_t> seen(n, 0);
        const int64_t* o = order.data();
        for (int64_t a = 0; a < n; ++a)
          if (o[a] < 0 || o[a] >= n || seen[o[a]]++) throw std::invalid_argument("order must be a permutation");
        std::vector<double> tv(times.data(), times.data() + K * n), fv(fill.data(), fill.data() + K);
        std::vector<int64_t> kv(k, k + kinds.shape(0)), ov(o, o + n);
        dyn::DispatchResult res;
        {
          py::gil_scoped_release release;
          res = dyn::dispatch(tv, kv, fv, ov, n, rounds);
        }
        return py::make_tuple(res.bad, res.members, res.finish);
      },
      py::arg("times"), py::arg("kinds"), py::arg("fill"), py::arg("order"), py::arg("rounds"),
      "stage-1 dispatch (plan/assignment/dispatch.py): the greedy in the given order, then up to rounds improvement rounds; "
      "(sequence that fits nowhere or -1, members per pipeline, finish per pipeline)");
}
