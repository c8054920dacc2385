// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/selfdistill.hpp>

#include "common.hpp"

#include <medusa_llama/prompt_file.hpp>

#include <medusa/acceptance.hpp>
#include <medusa/candidates.hpp>
#include <medusa/decoder.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <set>
#include <string_view>

namespace medusa_train {

namespace {

using detail::below;
using detail::read_file;
using detail::clock_type;
using detail::mix;
using detail::seconds_since;

const std::set<std::string>& text_extensions() {
  static const std::set<std::string> e = {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".cxx",
                                          ".hh", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".toml", ".json", ".yaml",
                                          ".yml", ".cfg", ".ini", ".html", ".css", ".tex", ".cmake", ".kt", ".swift", ".rb",
                                          ".pl", ".lua", ".sql"};
  return e;
}

bool looks_textual(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  std::array<char, 4096> buf{};
  in.read(buf.data(), buf.size());
  const auto n = static_cast<std::size_t>(in.gcount());
  return n > 0 && std::find(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n), '\0') == buf.begin() + static_cast<std::ptrdiff_t>(n);
}

bool held_out(std::string_view key, double fraction) {
  return static_cast<double>(fnv1a64(key) % 1000000) < fraction * 1e6;
}

}  // namespace

prompt_set prompt_set::from_corpus(const std::filesystem::path& dir, double eval_fraction) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) throw medusa::invalid_input("corpus " + dir.string() + " is not a directory");
  if (!(eval_fraction >= 0 && eval_fraction < 1)) throw medusa::invalid_input("eval fraction must be in [0, 1)");
  prompt_set s;
  s.corpus_ = true;
  s.root_ = std::filesystem::absolute(dir);
  std::vector<std::filesystem::path> files;
  for (auto it = std::filesystem::recursive_directory_iterator(s.root_, std::filesystem::directory_options::skip_permission_denied, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const auto& p = it->path();
    if (!text_extensions().count(p.extension().string())) continue;
    const auto size = it->file_size(ec);
    if (ec || size == 0 || size > (8u << 20)) continue;
    if (!looks_textual(p)) continue;
    files.push_back(p);
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw medusa::invalid_input("corpus " + dir.string() + " has no text or source file");
  for (const auto& f : files) (held_out(f.lexically_relative(s.root_).generic_string(), eval_fraction) ? s.eval_files_ : s.train_files_).push_back(f);
  if (eval_fraction > 0 && s.eval_files_.empty() && s.train_files_.size() >= 2) {
    s.eval_files_.push_back(s.train_files_.back());
    s.train_files_.pop_back();
  }
  if (s.train_files_.empty()) std::swap(s.train_files_, s.eval_files_);
  return s;
}

prompt_set prompt_set::from_file(const std::filesystem::path& file, double eval_fraction) {
  if (!(eval_fraction >= 0 && eval_fraction < 1)) throw medusa::invalid_input("eval fraction must be in [0, 1)");
  prompt_set s;
  const std::vector<std::string> lines = medusa_llama::read_prompt_lines(file);
  const std::size_t every = eval_fraction > 0 ? std::max<std::size_t>(2, static_cast<std::size_t>(std::lround(1.0 / eval_fraction))) : 0;
  for (std::size_t i = 0; i < lines.size(); ++i)
    (every && lines.size() >= 2 && i % every == every - 1 ? s.eval_lines_ : s.train_lines_).push_back(lines[i]);
  if (eval_fraction > 0 && s.eval_lines_.empty() && s.train_lines_.size() >= 2) {
    s.eval_lines_.push_back(s.train_lines_.back());
    s.train_lines_.pop_back();
  }
  return s;
}

std::vector<std::filesystem::path> prompt_set::all_files() const {
  std::vector<std::filesystem::path> a = train_files_;
  a.insert(a.end(), eval_files_.begin(), eval_files_.end());
  std::sort(a.begin(), a.end());
  return a;
}

std::vector<int> prompt_set::prompt(split s, std::uint64_t index, std::uint64_t seed, const medusa_llama::tokenizer& tok, int min_len,
                                    int max_len) const {
  if (min_len < 2 || max_len < min_len) throw medusa::invalid_input("prompt length range [" + std::to_string(min_len) + ", " + std::to_string(max_len) + "] is invalid (min >= 2)");
  if (!has(s)) throw medusa::invalid_input(std::string("no ") + (s == split::train ? "training" : "held-out") + " prompts");
  std::uint64_t r = mix(seed ^ mix(index * 2 + static_cast<std::uint64_t>(s)));
  const int want = min_len + static_cast<int>(below(r, static_cast<std::uint64_t>(max_len - min_len + 1)));
  std::string text;
  if (!corpus_) {
    const auto& L = lines(s);
    text = L[index % L.size()];
  } else {
    const auto& F = files(s);
    r = mix(r);
    const std::string content = read_file(F[below(r, F.size())]);
    // A third of the prompts start at the top of a file (as training documents did), the rest at
    // a random line.
    std::size_t start = 0;
    r = mix(r);
    if (below(r, 3) != 0 && content.size() > 1) {
      r = mix(r);
      std::size_t at = below(r, content.size());
      const auto nl = content.rfind('\n', at);
      start = nl == std::string::npos ? 0 : nl + 1;
      if (start >= content.size()) start = 0;
    }
    text = content.substr(start, static_cast<std::size_t>(max_len) * 8);
  }
  std::vector<int> ids = tok.encode(text, true, false);
  if (ids.empty() || ids[0] != tok.bos_id()) ids.insert(ids.begin(), tok.bos_id());
  if (static_cast<int>(ids.size()) > want) ids.resize(static_cast<std::size_t>(want));
  return ids;
}

std::vector<int> lookup_draft(std::span<const int> ctx, int ngram, int max_draft) {
  std::vector<int> out;
  if (max_draft <= 0) return out;
  const std::size_t n_ctx = ctx.size();
  for (int n = std::min<int>(ngram, static_cast<int>(n_ctx) - 1); n >= 1; --n) {
    const auto un = static_cast<std::size_t>(n);
    const auto tail = ctx.subspan(n_ctx - un);
    // Most recent earlier occurrence: start positions i with i + n < n_ctx, scanning backwards.
    for (std::size_t i = n_ctx - un; i-- > 0;) {
      if (!std::equal(tail.begin(), tail.end(), ctx.begin() + static_cast<std::ptrdiff_t>(i))) continue;
      for (std::size_t j = i + un; j < n_ctx && out.size() < static_cast<std::size_t>(max_draft); ++j) out.push_back(ctx[j]);
      return out;
    }
  }
  return out;
}

distill_stats generate_distill(medusa_llama::engine& e, const medusa_llama::tokenizer& tok, const prompt_set& prompts,
                               const distill_options& opt, distill_cache_writer& out, const distill_cache* resume) {
  const auto& cfg = e.config();
  const auto V = static_cast<std::size_t>(cfg.vocab_size), d = static_cast<std::size_t>(cfg.dim);
  if (opt.gen_len < 3) throw medusa::invalid_input("distill: gen_len must be >= 3, got " + std::to_string(opt.gen_len));
  if (opt.prompt_min < 2 || opt.prompt_max < opt.prompt_min)
    throw medusa::invalid_input("distill: bad prompt length range [" + std::to_string(opt.prompt_min) + ", " + std::to_string(opt.prompt_max) + "]");
  if (!(opt.temperature >= 0) || !std::isfinite(opt.temperature)) throw medusa::invalid_input("distill: temperature must be >= 0");
  if (opt.draft < 0 || opt.ngram < 1) throw medusa::invalid_input("distill: draft must be >= 0 and ngram >= 1");
  if (tok.vocab_size() != cfg.vocab_size)
    throw medusa::invalid_input("distill: tokenizer has " + std::to_string(tok.vocab_size()) + " tokens, the model " + std::to_string(cfg.vocab_size));
  if (resume != nullptr && (resume->hidden_size() != d || resume->vocab_size() != V))
    throw medusa::invalid_input("distill: the cache to resume holds d=" + std::to_string(resume->hidden_size()) + " V=" +
                                std::to_string(resume->vocab_size()) + ", the model has d=" + std::to_string(d) + " V=" + std::to_string(V));
  const int cap = e.capacity();
  if (opt.prompt_max + 2 >= cap) throw medusa::invalid_input("distill: prompts of " + std::to_string(opt.prompt_max) + " tokens leave no room in a context of " + std::to_string(cap));
  const int max_batch = e.options().max_batch;
  const int draft = opt.temperature > 0 ? 0 : std::min(opt.draft, max_batch - 1);
  const int eos = tok.eos_id();
  const bool have_eval = opt.eval_fraction > 0 && prompts.has(split::eval);

  const auto t0 = clock_type::now();
  auto last_report = t0;
  distill_stats st;
  // Sampled continuations draw from the temperature-scaled distribution with the library's
  // counter-based sampler (one Philox counter per draw).
  const medusa::sampling_warp warp{opt.temperature, 0, 1.0f};
  medusa::acceptance_workspace ws(0, cfg.vocab_size);
  std::uint64_t draws = 0;
  std::vector<float> logits(static_cast<std::size_t>(max_batch) * V), hidden(static_cast<std::size_t>(max_batch) * d);
  std::vector<std::int32_t> toks;
  std::vector<float> hid;
  std::vector<int> ctx, batch, positions;
  std::uint64_t train_index = 0, eval_index = 0;
  std::uint64_t generated = 0;
  auto choose = [&](std::span<const float> z) {
    return opt.temperature > 0 ? medusa::sample_token(z, warp, opt.seed ^ 0xd15711ull, draws++, ws) : medusa::argmax(z);
  };
  if (resume != nullptr) {
    // The state after the resumed records, rebuilt from them: the counts that pick the next split,
    // prompt index per split and, for sampled data, the draw counter (one draw per generated
    // token: sampling runs without drafts).
    out.append(*resume);
    for (std::size_t r = 0; r < resume->size(); ++r) {
      const auto& rec = (*resume)[r];
      const std::uint64_t n = rec.tokens.size();
      ++(rec.which == split::eval ? eval_index : train_index);
      (rec.which == split::eval ? st.eval_rows : st.train_rows) += n;
      st.rows += n;
      draws += n - 1;
    }
    st.sequences = st.reused_sequences = resume->size();
    st.reused_rows = st.rows;
  }
  while (st.rows < opt.tokens) {
    if (opt.deadline && clock_type::now() >= *opt.deadline) {
      st.deadline_hit = true;
      break;
    }
    const split which = have_eval && static_cast<double>(st.eval_rows) < opt.eval_fraction * static_cast<double>(st.rows + 1) ? split::eval : split::train;
    const std::uint64_t index = which == split::eval ? eval_index++ : train_index++;
    const std::vector<int> prompt = prompts.prompt(which, index, opt.seed, tok, opt.prompt_min, opt.prompt_max);
    const int P = static_cast<int>(prompt.size());
    e.prefill(prompt, 0, std::span(logits).first(V), std::span(hidden).first(d));
    toks.assign(1, prompt.back());
    hid.assign(hidden.begin(), hidden.begin() + static_cast<std::ptrdiff_t>(d));
    ctx = prompt;
    const auto room = static_cast<std::uint64_t>(opt.tokens - st.rows);
    int left = static_cast<int>(std::min<std::uint64_t>(static_cast<std::uint64_t>(opt.gen_len), room > 1 ? room - 1 : 1));
    int pos = P;
    int next = choose(std::span(logits).first(V));
    for (;;) {
      // `next` is the token at position `pos`; its hidden state comes from the batch below.
      toks.push_back(next);
      ctx.push_back(next);
      --left;
      ++generated;
      if (next == eos || left <= 0 || pos + 1 >= cap) {
        hid.insert(hid.end(), d, 0.0f);  // the last row's state is never read (no target after it)
        break;
      }
      const int max_d = std::min({draft, left, cap - pos - 1});
      batch.assign(1, next);
      if (max_d > 0) {
        const auto dr = lookup_draft(ctx, opt.ngram, max_d);
        batch.insert(batch.end(), dr.begin(), dr.end());
      }
      const int T = static_cast<int>(batch.size());
      positions.resize(static_cast<std::size_t>(T));
      for (int i = 0; i < T; ++i) positions[static_cast<std::size_t>(i)] = pos + i;
      const auto uT = static_cast<std::size_t>(T);
      medusa::forward_batch fb;
      fb.tokens = batch;
      fb.positions = positions;
      fb.cache_length = pos;
      fb.logits = std::span(logits).first(uT * V);
      fb.hidden = std::span(hidden).first(uT * d);
      e.forward(fb);
      ++st.forwards;
      st.drafted += static_cast<std::uint64_t>(T - 1);
      hid.insert(hid.end(), hidden.begin(), hidden.begin() + static_cast<std::ptrdiff_t>(d));
      int a = 0;
      bool stop = false;
      while (a < T - 1 && medusa::argmax(std::span<const float>(logits).subspan(static_cast<std::size_t>(a) * V, V)) == batch[static_cast<std::size_t>(a) + 1]) {
        const int tk = batch[static_cast<std::size_t>(a) + 1];
        ++a;
        toks.push_back(tk);
        ctx.push_back(tk);
        hid.insert(hid.end(), hidden.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(a) * d),
                   hidden.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(a + 1) * d));
        --left;
        ++generated;
        if (tk == eos || left <= 0) {
          stop = true;
          break;
        }
      }
      st.accepted += static_cast<std::uint64_t>(a);
      if (stop) break;
      next = choose(std::span<const float>(logits).subspan(static_cast<std::size_t>(a) * V, V));
      pos += 1 + a;
    }
    out.add(toks, hid, which, static_cast<std::uint32_t>(P));
    ++st.sequences;
    st.rows += toks.size();
    (which == split::eval ? st.eval_rows : st.train_rows) += toks.size();
    if (opt.on_progress && seconds_since(last_report) >= opt.progress_interval) {
      last_report = clock_type::now();
      distill_progress p;
      p.rows = st.rows;
      p.target_rows = opt.tokens;
      p.sequences = st.sequences;
      p.elapsed = seconds_since(t0);
      p.tokens_per_second = static_cast<double>(generated) / std::max(1e-9, p.elapsed);
      p.eta = p.elapsed / static_cast<double>(st.rows - st.reused_rows) * static_cast<double>(opt.tokens - std::min(opt.tokens, st.rows));
      opt.on_progress(p);
    }
  }
  st.seconds = seconds_since(t0);
  if (opt.on_progress) {
    distill_progress p;
    p.rows = st.rows;
    p.target_rows = opt.tokens;
    p.sequences = st.sequences;
    p.elapsed = st.seconds;
    p.tokens_per_second = static_cast<double>(generated) / std::max(1e-9, st.seconds);
    opt.on_progress(p);
  }
  return st;
}

}  // namespace medusa_train
