//! The engine thread: take requests, plan a step, run it, sample, send events; repeat
//! while anything runs, sleep on the channel when nothing does.

use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use super::embed::Pooled;
use super::speculate::{judge, lookup_drafts, SpecState};
use super::{
    BatchRunner, Command, Event, EventSink, FinishReason, PromptScore, Request, StatsCell,
    TokenEvent, Usage,
};
use rayon::prelude::*;

use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::constraint::{apply_mask, Constraint, MaskSlot};
use crate::kv::BlockManager;
use crate::models::Model;
use crate::sampler::Sampler;
use crate::scheduler::{Scheduled, Scheduler, SchedulerConfig, SeqId, Sequence, Step};
use crate::spec::draft::DraftModel;
use crate::spec::{DraftPolicy, SpecConfig, SpecCosts};
use crate::stop::StopFilter;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// A request in flight: what the engine keeps beside the scheduler's sequence.
struct Live<'t> {
    request: Request,
    /// Out of it while a step that samples it runs.
    sampler: Option<Sampler>,
    decoder: IncrementalDecoder<'t>,
    filter: StopFilter,
    sink: EventSink,
    generated: usize,
    /// Prompt scores by position (`score_from..prompt_len - 1`), filled as chunks run.
    scores: Vec<PromptScore>,
    /// The scores went out (a preempted sequence recomputes its prompt: not again).
    scores_sent: bool,
    spec: SpecState,
    /// An embedding request's states so far.
    pooled: Pooled,
}

pub(super) fn run(
    model: Arc<Model>,
    mut runner: Box<dyn BatchRunner>,
    config: SchedulerConfig,
    mut spec: Option<SpecConfig>,
    mut draft: Option<DraftModel>,
    rx: Receiver<Command>,
    stats: &StatsCell,
) {
    let tok = &model.tokenizer;
    let blocks = BlockManager::new(runner.num_blocks(), runner.block_size());
    let mut sched = Scheduler::new(config, blocks);
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    let mut costs = SpecCosts::default();
    loop {
        stats.publish(
            sched.num_running(),
            sched.num_waiting(),
            sched.blocks.num_blocks() - sched.blocks.num_free(),
        );
        let first = if sched.is_idle() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match cmd {
                Command::Add { id, request, sink } => {
                    let request = *request;
                    let Ok(mut sampler) = Sampler::new(request.params.sampler.clone()) else {
                        continue; // validated at submission
                    };
                    request.prompt.iter().for_each(|&t| sampler.accept(t));
                    let mut seq = Sequence::new(id, request.prompt.clone());
                    seq.use_prefix_cache = request.params.score_from.is_none()
                        && request
                            .params
                            .embed
                            .is_none_or(|p| p.may_use_prefix_cache());
                    let n_scores = request
                        .params
                        .score_from
                        .map_or(0, |f| request.prompt.len() - 1 - f);
                    live.insert(
                        id,
                        Live {
                            filter: StopFilter::new(request.params.stop.clone()),
                            request,
                            sampler: Some(sampler),
                            decoder: IncrementalDecoder::new(tok, false),
                            sink,
                            generated: 0,
                            scores: vec![PromptScore::default(); n_scores],
                            scores_sent: false,
                            spec: SpecState::starting_at(costs.acceptance()),
                            pooled: Pooled::default(),
                        },
                    );
                    sched.add(seq);
                }
                Command::Cancel(id) => {
                    sched.remove(id);
                    live.remove(&id);
                }
                Command::Shutdown => return,
            }
        }
        if sched.is_idle() {
            continue;
        }
        let drafting = Instant::now();
        if let Some(c) = spec.clone() {
            if let Some(d) = draft.as_mut() {
                d.retain(|id| live.contains_key(&id));
            }
            if let Err(e) = add_drafts(&mut sched, &mut live, &c, &costs, draft.as_mut()) {
                // The draft model failed: go on without speculation (every sequence decodes
                // plainly; the text goes to stderr, where the server's log is).
                eprintln!("memra: the draft model failed, speculation is off: {e}");
                (spec, draft) = (None, None);
                for (&id, l) in live.iter_mut() {
                    if !l.spec.draft.is_empty() {
                        sched.settle_draft(id, 0);
                        l.spec.draft.clear();
                        l.spec.q = None;
                    }
                }
            }
        }
        let drafting = drafting.elapsed();
        let step = sched.schedule();
        // Drafts of sequences the step does not compute (preempted, or no budget left) go.
        for (&id, l) in live.iter_mut() {
            if !l.spec.draft.is_empty() && !step.seqs.iter().any(|s| s.id == id) {
                sched.settle_draft(id, 0);
                l.spec.draft.clear();
                l.spec.q = None;
                // The draft model's cache holds the dropped drafts: only the verified
                // tokens stand.
                if let (Some(d), Some(seq)) = (draft.as_mut(), sched.get(id)) {
                    d.settle(id, seq.tokens.len());
                }
            }
        }
        if step.seqs.is_empty() {
            // Nothing fits although nothing else holds the pool: requests are checked
            // against the pool's size when submitted, so this is a bug; fail the requests
            // rather than spin.
            let ids: Vec<SeqId> = live.keys().copied().collect();
            for id in ids {
                fail(
                    &mut sched,
                    &mut live,
                    id,
                    "the KV pool cannot hold the request",
                );
            }
            continue;
        }
        let (batch, rows) = build_batch(&step, &sched, &live, runner.block_size());
        // The grammars of the constrained sequences that sample: their masks are computed
        // on a thread of their own while the forward runs (the runner waits for a row's
        // mask only when it picks that row's token: on a GPU, after the step's kernels are
        // launched).
        let mut constrained = take_constraints(&step, &mut live);
        let slots: Vec<MaskSlot> = constrained.iter().map(|_| MaskSlot::default()).collect();
        let slot_of: HashMap<SeqId, &MaskSlot> =
            constrained.iter().map(|(id, _)| *id).zip(&slots).collect();
        // Each sequence's last row is sampled by the runner (on the device where it can;
        // among its grammar's tokens for a constrained one) unless its log-probabilities
        // are wanted; scoring rows come back as logits. The samplers leave their sequences
        // for the step.
        // A verify step's rows (the sequence's last token and its drafts) are all picked:
        // by the device for plain greedy sampling, else as logits for the host's verifier.
        let mut samplers: Vec<Sampler> = Vec::new();
        let mut plan: Vec<Pick> = Vec::with_capacity(batch.logit_rows.len());
        for (s, &(n_rows, _)) in step.seqs.iter().zip(&rows) {
            let l = live.get_mut(&s.id).expect("live sequences are scheduled");
            if !l.spec.draft.is_empty() {
                let greedy = l.sampler.as_ref().is_some_and(Sampler::is_plain_greedy);
                let pick = if greedy { Pick::Greedy } else { Pick::Logits };
                plan.extend(std::iter::repeat_n(pick, n_rows));
                continue;
            }
            let sample_here = s.logits && l.request.params.logprobs.is_none() && l.runner_samples();
            plan.extend(std::iter::repeat_n(Pick::Logits, n_rows));
            if sample_here {
                *plan.last_mut().expect("a sampled sequence has its row") = match slot_of.get(&s.id)
                {
                    Some(slot) => Pick::Masked(slot),
                    None => Pick::Sample,
                };
                samplers.push(l.sampler.take().expect("a sampler per sequence"));
            }
        }
        let mut it = samplers.iter_mut();
        let mut picks: Vec<RowPick> = plan
            .iter()
            .map(|&p| match p {
                Pick::Sample => RowPick::Sample(it.next().expect("one per sampled row")),
                Pick::Masked(slot) => {
                    RowPick::Masked(it.next().expect("one per sampled row"), slot)
                }
                Pick::Greedy => RowPick::Greedy,
                Pick::Logits => RowPick::Logits,
            })
            .collect();
        let started = Instant::now();
        let result = std::thread::scope(|scope| {
            if !constrained.is_empty() {
                let (constrained, slots) = (&mut constrained, &slots);
                scope.spawn(move || compute_masks(constrained, slots));
            }
            // A panic in a backend is a bug, but it fails this step's requests, not the
            // engine and every request after them.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                runner.forward(&batch, &mut picks)
            }))
            .unwrap_or_else(|_| Err("internal error in the forward pass".to_string()))
        });
        drop(picks);
        // Every mask is in its slot now (the thread is joined).
        let masks: HashMap<SeqId, Result<&[u32], &str>> = slot_of
            .iter()
            .map(|(&id, slot)| (id, slot.result()))
            .collect();
        for (id, c) in constrained {
            if let Some(l) = live.get_mut(&id) {
                l.request.params.constraint = Some(c);
            }
        }
        let mut samplers = samplers.into_iter();
        for s in &step.seqs {
            let l = live.get_mut(&s.id).expect("live sequences are scheduled");
            if l.sampler.is_none() {
                l.sampler = samplers.next();
            }
        }
        let mut outputs = match result {
            Ok(o) => o,
            Err(e) => {
                for s in &step.seqs {
                    fail(&mut sched, &mut live, s.id, &e);
                }
                continue;
            }
        };
        if spec.is_some() {
            let caught_up = draft.as_ref().map_or(0, DraftModel::caught_up);
            let secs = (drafting + started.elapsed()).as_secs_f64();
            record_costs(&mut costs, &step, &live, caught_up, secs);
        }
        sched.complete(&step);
        let mut hidden = outputs
            .split_off(batch.logit_rows.len().min(outputs.len()))
            .into_iter();
        let mut outputs = outputs.into_iter();
        for (s, (n_rows, n_hidden)) in step.seqs.iter().zip(rows) {
            let seq_rows: Vec<RowOut> = outputs.by_ref().take(n_rows).collect();
            let l = live.get_mut(&s.id).expect("live sequences are scheduled");
            if l.request.params.embed.is_some() {
                let states: Option<Vec<Vec<f32>>> = hidden
                    .by_ref()
                    .take(n_hidden)
                    .map(|r| match r {
                        RowOut::Hidden(h) => Some(h),
                        _ => None,
                    })
                    .collect();
                let Some(states) = states.filter(|v| v.len() == n_hidden) else {
                    fail(
                        &mut sched,
                        &mut live,
                        s.id,
                        "the backend returned no hidden states",
                    );
                    continue;
                };
                l.pooled.add(s.start, states);
                if s.logits {
                    // The prompt's last token is computed: the embedding is complete.
                    (l.sink)(Event::Embedding(l.pooled.take()));
                    finish(&mut sched, &mut live, s.id, FinishReason::Length);
                }
                continue;
            }
            if !l.spec.draft.is_empty() {
                if let Err(e) = settle(tok, l, seq_rows, &mut sched, s, draft.as_mut(), &mut costs)
                {
                    match e {
                        Ok(reason) => finish(&mut sched, &mut live, s.id, reason),
                        Err(e) => fail(&mut sched, &mut live, s.id, &e),
                    }
                }
                continue;
            }
            if let Some(from) = l.request.params.score_from.filter(|_| !l.scores_sent) {
                let tokens = &l.request.prompt;
                let top = l.request.params.logprobs;
                for (i, row) in scored_positions(s, from, tokens.len()).zip(&seq_rows) {
                    if let RowOut::Logits(row) = row {
                        l.scores[i - from] = PromptScore {
                            logprob: log_softmax_at(row, tokens[i + 1]),
                            top_logprobs: top.map_or(Vec::new(), |n| top_logprobs(row, n)),
                        };
                    }
                }
                if s.start + s.n >= tokens.len() {
                    send_scores(l);
                }
            }
            if !s.logits {
                continue;
            }
            let last = seq_rows
                .into_iter()
                .last()
                .expect("a row for the last token");
            let mask = match masks.get(&s.id) {
                Some(Err(e)) => {
                    let why = format!("the grammar failed: {e}");
                    fail(&mut sched, &mut live, s.id, &why);
                    continue;
                }
                Some(Ok(m)) => Some(*m),
                None => None,
            };
            match sample(tok, l, last, mask, &mut sched, s.id) {
                Ok(None) => {}
                Ok(Some(reason)) => finish(&mut sched, &mut live, s.id, reason),
                Err(e) => fail(&mut sched, &mut live, s.id, &e),
            }
        }
    }
}

impl Live<'_> {
    /// Whether the runner samples this sequence's next token (scoring requests whose
    /// generation is over take logits only).
    fn runner_samples(&self) -> bool {
        self.generated < self.request.params.max_tokens
    }
}

/// Positions of a scheduled chunk whose logits score the next prompt token.
fn scored_positions(s: &Scheduled, from: usize, prompt_len: usize) -> std::ops::Range<usize> {
    let lo = s.start.max(from);
    let hi = (s.start + s.n).min(prompt_len - 1);
    lo..hi.max(lo)
}

/// The step's batch, and how many logit rows and hidden rows each scheduled sequence gets.
fn build_batch(
    step: &Step,
    sched: &Scheduler,
    live: &HashMap<SeqId, Live>,
    block_size: usize,
) -> (ForwardBatch, Vec<(usize, usize)>) {
    let mut batch = ForwardBatch::new(block_size);
    let mut rows = Vec::with_capacity(step.seqs.len());
    for s in &step.seqs {
        let seq = sched.get(s.id).expect("scheduled sequences run");
        let tokens = &seq.tokens[s.start..s.start + s.n];
        if let Some(pooling) = live[&s.id].request.params.embed {
            let states = pooling.rows(s.start, s.n, seq.prompt_len);
            rows.push((0, states.len()));
            batch.push(tokens, s.start, &seq.blocks, []);
            batch.push_hidden(states);
            continue;
        }
        let mut want: Vec<usize> = match live[&s.id].request.params.score_from {
            Some(from) => scored_positions(s, from, seq.prompt_len)
                .map(|p| p - s.start)
                .collect(),
            None => Vec::new(),
        };
        let drafting = !live[&s.id].spec.draft.is_empty();
        if drafting {
            want = (0..s.n).collect();
        } else if s.logits && want.last() != Some(&(s.n - 1)) {
            want.push(s.n - 1);
        }
        rows.push((want.len(), 0));
        batch.push(tokens, s.start, &seq.blocks, want);
        if drafting && s.n > 1 {
            batch.mark_as_decodes();
        }
    }
    (batch, rows)
}

/// `log softmax(row)[id]`.
fn log_softmax_at(row: &[f32], id: u32) -> f32 {
    crate::sampler::log_prob(row, id) as f32
}

/// The `n` best tokens of `row` with their log-probabilities.
fn top_logprobs(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let n = n.min(row.len());
    if n == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(n - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    idx.truncate(n);
    idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    idx.iter().map(|&i| (i, log_softmax_at(row, i))).collect()
}

/// The constraints of the step's sequences that sample, out of their sequences for the
/// step.
fn take_constraints(step: &Step, live: &mut HashMap<SeqId, Live>) -> Vec<(SeqId, Constraint)> {
    step.seqs
        .iter()
        .filter(|s| s.logits)
        .filter_map(|s| {
            let l = live.get_mut(&s.id)?;
            if !l.runner_samples() {
                return None;
            }
            l.request.params.constraint.take().map(|c| (s.id, c))
        })
        .collect()
}

/// Each constraint's mask into its slot, in parallel on rayon's threads (a mask takes from
/// tens of microseconds to a few milliseconds). Every slot is filled, a panic included
/// (the runner waits on them).
fn compute_masks(constrained: &mut [(SeqId, Constraint)], slots: &[MaskSlot]) {
    let one = |c: &mut Constraint, slot: &MaskSlot| {
        let m = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.mask()))
            .unwrap_or_else(|_| Err("internal error computing the mask".into()));
        slot.set(m);
    };
    if constrained.len() == 1 {
        one(&mut constrained[0].1, &slots[0]);
    } else {
        constrained
            .par_iter_mut()
            .zip(slots)
            .for_each(|((_, c), slot)| one(c, slot));
    }
}

/// Takes the next token of a sequence (sampled by the runner, or here from its logits,
/// among `mask`'s tokens when it has a grammar) and sends it; returns why the sequence
/// ends, if it does (else the token joins it), or an error that ends it.
fn sample(
    tok: &Tokenizer,
    l: &mut Live,
    row: RowOut,
    mask: Option<&[u32]>,
    sched: &mut Scheduler,
    id: SeqId,
) -> Result<Option<FinishReason>, String> {
    if l.generated >= l.request.params.max_tokens {
        return Ok(Some(FinishReason::Length)); // prompt scoring only
    }
    let sampler = l.sampler.as_mut().expect("sampler back after the step");
    let (next, logits) = match (row, mask) {
        (RowOut::Token(id), _) => (id, None),
        (RowOut::Hidden(_), _) => return Err("the backend returned a hidden state".into()),
        (RowOut::Logits(v), None) => (sampler.sample(&v), Some(v)),
        (RowOut::Logits(v), Some(m)) => {
            let mut masked = v.clone();
            apply_mask(&mut masked, m);
            (sampler.sample(&masked), Some(v))
        }
    };
    emit(tok, l, next, logits, Emit::Append, sched, id)
}

/// How [`emit`] leaves a token: appended to the sequence (a sampled token, computed by the
/// next step), or already in it and recorded by the sampler (an accepted draft).
#[derive(Clone, Copy, PartialEq)]
enum Emit {
    Append,
    /// The sequence holds it; `recorded`: the sampler has seen it.
    Held {
        recorded: bool,
    },
    /// Appended; the sampler has seen it (a verify step's own token).
    AppendRecorded,
}

/// Sends a sequence's next token; returns why the sequence ends, if it does, or an error
/// that ends it.
fn emit(
    tok: &Tokenizer,
    l: &mut Live,
    next: u32,
    logits: Option<Vec<f32>>,
    how: Emit,
    sched: &mut Scheduler,
    id: SeqId,
) -> Result<Option<FinishReason>, String> {
    let p = &mut l.request.params;
    // A grammar allows end-of-generation tokens only where it may end: they end it
    // whatever `ignore_eos` says.
    if tok.is_end_of_generation(next) && (!p.ignore_eos || p.constraint.is_some()) {
        return Ok(Some(FinishReason::EndOfGeneration));
    }
    if let Some(c) = p.constraint.as_mut() {
        c.accept(next)
            .map_err(|e| format!("token {next} does not fit the grammar: {e}"))?;
    }
    if matches!(how, Emit::Append | Emit::Held { recorded: false }) {
        l.sampler
            .as_mut()
            .expect("sampler back after the step")
            .accept(next);
    }
    l.generated += 1;
    let (logprob, top) = match (p.logprobs, &logits) {
        (Some(n), Some(v)) => (Some(log_softmax_at(v, next)), top_logprobs(v, n)),
        _ => (None, Vec::new()),
    };
    let piece = l.decoder.push(next).unwrap_or_default();
    let (text, hit) = l.filter.push(&piece);
    let delivered = (l.sink)(Event::Token(TokenEvent {
        id: next,
        text,
        logprob,
        top_logprobs: top,
    }));
    if !delivered {
        // Nobody listens: end it now (its blocks go back with the finish).
        return Ok(Some(FinishReason::Length));
    }
    if hit {
        return Ok(Some(FinishReason::StopString));
    }
    if p.constraint.as_ref().is_some_and(Constraint::is_finished) {
        return Ok(Some(FinishReason::EndOfGeneration));
    }
    if l.generated >= p.max_tokens {
        return Ok(Some(FinishReason::Length));
    }
    if matches!(how, Emit::Append | Emit::AppendRecorded) {
        sched.append(id, next);
    }
    Ok(None)
}

/// What a step picks for a row.
#[derive(Clone, Copy)]
enum Pick<'a> {
    Logits,
    Greedy,
    Sample,
    Masked(&'a MaskSlot),
}

/// Appends drafts to the sequences that decode this step and can speculate: while few
/// sequences run, no grammar, log-probabilities or prompt scoring. Drafts come from the
/// draft model where there is one (its error is returned), else from prompt lookup.
fn add_drafts(
    sched: &mut Scheduler,
    live: &mut HashMap<SeqId, Live>,
    c: &SpecConfig,
    costs: &SpecCosts,
    draft: Option<&mut DraftModel>,
) -> Result<(), String> {
    let n = sched.num_running();
    // The cost rule weighs drafts against a plain step of as many decodes: one is
    // measured first.
    if n > c.max_batch || (c.policy == DraftPolicy::Cost && costs.plain(n).is_none()) {
        return Ok(());
    }
    // (sequence, drafts at most, drafts at least)
    let mut want: Vec<(SeqId, usize, usize)> = Vec::new();
    for (&id, l) in live.iter_mut() {
        let p = &l.request.params;
        if p.constraint.is_some()
            || p.logprobs.is_some()
            || p.score_from.is_some()
            || p.embed.is_some()
        {
            continue;
        }
        let Some(seq) = sched.get(id) else { continue };
        if !sched.is_running(id) || seq.remaining() != 1 || seq.draft > 0 {
            continue;
        }
        // The drafts and the token after them stay within max_tokens (and so within the
        // context, which the request was checked against).
        let room = p.max_tokens.saturating_sub(l.generated + 1);
        let most = c.draft_max.min(room).min(p.draft_max.unwrap_or(usize::MAX));
        let least = p.draft_min.unwrap_or(c.draft_min).max(1);
        let k = l.spec.length.next(c.policy, costs.ratio(n), least, most);
        if k >= least {
            want.push((id, k, least));
        }
    }
    // In admission order, so that a run repeats exactly (the map's order does not).
    want.sort_unstable();
    let Some(draft) = draft else {
        for (id, k, least) in want {
            let tokens = &sched.get(id).expect("running").tokens;
            let d = lookup_drafts(tokens, c.ngram, k, least);
            if !d.is_empty() {
                sched.add_draft(id, &d);
                live.get_mut(&id).expect("live").spec.draft = d;
            }
        }
        return Ok(());
    };
    let asks: Vec<_> = want
        .iter()
        .map(|&(id, k, _)| {
            let tokens = sched.get(id).expect("running").tokens.as_slice();
            (id, tokens, k, &live[&id].request.params.sampler)
        })
        .collect();
    let mut proposals = draft.propose(&asks)?;
    for (id, _, _) in want {
        let Some(p) = proposals.remove(&id) else {
            continue;
        };
        if p.tokens.is_empty() {
            continue;
        }
        sched.add_draft(id, &p.tokens);
        let l = live.get_mut(&id).expect("live");
        l.spec.draft = p.tokens;
        l.spec.q = p.q;
    }
    Ok(())
}

/// Most tokens a sequence of a measured step may catch up with in the draft model: the
/// catch-up after a verify step is one or two, after a plain step a few more; a new
/// sequence's whole prompt is not a draft's cost.
const MEASURED_CATCH_UP: usize = 4;

/// Measures a step of decodes for the cost rule (`spec::DraftLength`): without drafts, a
/// plain step of that many decodes; with them, what each draft added, drafting and
/// verifying (`secs` is both). Steps with prompt chunks are not measured.
fn record_costs(
    costs: &mut SpecCosts,
    step: &Step,
    live: &HashMap<SeqId, Live>,
    caught_up: usize,
    secs: f64,
) {
    let mut drafts = 0;
    for s in &step.seqs {
        let verifies = live.get(&s.id).is_some_and(|l| !l.spec.draft.is_empty());
        if verifies {
            drafts += s.n - 1;
        } else if s.n != 1 || !s.logits {
            return;
        }
    }
    match drafts {
        0 => costs.record_plain(step.seqs.len(), secs),
        _ if caught_up <= MEASURED_CATCH_UP => costs.record_cycle(step.seqs.len(), drafts, secs),
        _ => {}
    }
}

/// A verify step's result for one sequence: the drafts it accepted and its own next token
/// sent, the rest dropped. Err holds why the sequence ends (or its error).
fn settle(
    tok: &Tokenizer,
    l: &mut Live,
    rows: Vec<RowOut>,
    sched: &mut Scheduler,
    s: &Scheduled,
    draft: Option<&mut DraftModel>,
    costs: &mut SpecCosts,
) -> Result<(), Result<FinishReason, String>> {
    let drafted = std::mem::take(&mut l.spec.draft);
    let q = l.spec.q.take();
    // The step computed the last token and `s.n - 1` drafts (fewer than drafted when the
    // budget cut the chunk).
    let computed = &drafted[..s.n - 1];
    let sampler = l
        .sampler
        .as_mut()
        .expect("a verify step leaves the sampler");
    let (v, recorded) = judge(rows, computed, q.as_deref(), sampler);
    sched.settle_draft(s.id, v.accepted);
    if let Some(d) = draft {
        // The draft's own keys and values hold until the first rejected draft.
        d.settle(s.id, s.start + 1 + v.accepted);
    }
    l.spec.drafted += computed.len();
    l.spec.accepted += v.accepted;
    l.spec.length.record(v.accepted, computed.len());
    costs.record_verify(v.accepted, computed.len());
    let held = Emit::Held { recorded };
    let last = match recorded {
        true => Emit::AppendRecorded,
        false => Emit::Append,
    };
    let tokens = computed[..v.accepted].iter().map(|&t| (t, held));
    for (t, how) in tokens.chain([(v.next, last)]) {
        match emit(tok, l, t, None, how, sched, s.id) {
            Ok(None) => {}
            Ok(Some(reason)) => return Err(Ok(reason)),
            Err(e) => return Err(Err(e)),
        }
    }
    Ok(())
}

/// Ends a sequence: the text held back, the scores, the counts; its blocks go back.
fn finish(
    sched: &mut Scheduler,
    live: &mut HashMap<SeqId, Live>,
    id: SeqId,
    mut reason: FinishReason,
) {
    let seq = sched.remove(id);
    let Some(mut l) = live.remove(&id) else {
        return;
    };
    send_scores(&mut l);
    let mut text = String::new();
    if reason != FinishReason::StopString {
        let (t, hit) = l.filter.push(&l.decoder.finish());
        text = t + &l.filter.take_held();
        if hit {
            // The decoder's last bytes completed a stop string: the text ends before it.
            reason = FinishReason::StopString;
        }
    }
    let usage = Usage {
        prompt_tokens: l.request.prompt.len(),
        completion_tokens: l.generated,
        cached_tokens: seq.as_ref().and_then(|s| s.cached_tokens).unwrap_or(0),
        preemptions: seq.as_ref().map_or(0, |s| s.preemptions),
        draft_tokens: l.spec.drafted,
        accepted_tokens: l.spec.accepted,
    };
    let stop = l.filter.matched().map(str::to_string);
    (l.sink)(Event::Finished {
        reason,
        text,
        usage,
        stop,
    });
}

/// A scoring request's prompt scores, once (whether the client is still there shows at
/// its next token).
fn send_scores(l: &mut Live) {
    if l.request.params.score_from.is_some() && !l.scores_sent {
        l.scores_sent = true;
        (l.sink)(Event::PromptScores(std::mem::take(&mut l.scores)));
    }
}

fn fail(sched: &mut Scheduler, live: &mut HashMap<SeqId, Live>, id: SeqId, why: &str) {
    if let Some(mut l) = live.remove(&id) {
        (l.sink)(Event::Error(why.to_string()));
    }
    sched.remove(id);
}
