//! The `memra` binary end to end: `inspect` against gguf-py's view of every model, bad
//! files and bad arguments, and `synth` output read back.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

use memra_gguf::test_files::{malformed_corpus, real_model, tiny_model};
use serde_json::Value;

fn memra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memra"))
        .args(args)
        .output()
        .expect("run memra")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// Label -> value of the `label   value` lines of `memra inspect`.
fn fields(text: &str) -> HashMap<String, String> {
    text.lines()
        .take_while(|l| !l.is_empty())
        .filter(|l| l.len() > 16)
        .map(|l| (l[..16].trim().to_string(), l[16..].to_string()))
        .collect()
}

/// Type -> (tensors, bytes) from the type table.
fn type_table(text: &str) -> HashMap<String, (u64, u64)> {
    let num = |s: &str| s.replace(',', "").parse::<u64>().unwrap();
    text.lines()
        .skip_while(|l| !l.starts_with("type "))
        .skip(1)
        .take_while(|l| !l.starts_with("total"))
        .map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c[0].to_string(), (num(c[1]), num(c[3])))
        })
        .collect()
}

const LABELS: [(&str, &str); 9] = [
    ("context_length", "context length"),
    ("embedding_length", "embedding"),
    ("block_count", "layers"),
    ("feed_forward_length", "ffn width"),
    ("attention.head_count", "heads"),
    ("attention.head_count_kv", "kv heads"),
    ("attention.key_length", "head dim (k)"),
    ("attention.sliding_window", "sliding window"),
    ("expert_count", "experts"),
];

fn check_against_reference(path: &Path, want: &Value) {
    let out = memra(&["inspect", path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    let f = fields(&text);
    let what = path.display();
    assert_eq!(
        f["architecture"],
        want["architecture"].as_str().unwrap(),
        "{what}"
    );
    assert!(
        f["format"].contains(&format!(
            "{} metadata keys, {} tensors",
            want["metadata_keys"], want["tensors"]
        )),
        "{what}: {}",
        f["format"]
    );
    assert!(f["file"].contains(&format!(
        "({} bytes",
        group(want["file_size"].as_u64().unwrap())
    )));
    for (key, label) in LABELS {
        if let Some(v) = want["hyperparameters"].get(key) {
            assert_eq!(f[label], v.to_string(), "{what}: {label}");
        }
    }
    let tok = &f["tokenizer"];
    assert!(
        tok.starts_with(want["tokenizer_model"].as_str().unwrap()),
        "{what}: {tok}"
    );
    assert!(
        tok.contains(&format!("{} tokens", want["n_tokens"])),
        "{what}: {tok}"
    );
    let table = type_table(&text);
    let want_types = want["types"].as_object().unwrap();
    assert_eq!(table.len(), want_types.len(), "{what}: {table:?}");
    for (ty, v) in want_types {
        let (n, bytes) = (v[0].as_u64().unwrap(), v[1].as_u64().unwrap());
        assert_eq!(table[ty], (n, bytes), "{what}: {ty}");
    }
}

fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn reference() -> serde_json::Map<String, Value> {
    let v: Value = serde_json::from_str(include_str!("data/inspect-reference.json")).unwrap();
    v.as_object().unwrap().clone()
}

#[test]
fn inspect_reports_tiny_models_as_gguf_py_sees_them() {
    let r = reference();
    let tiny: Vec<_> = r.iter().filter(|(k, _)| k.starts_with("tiny-")).collect();
    assert_eq!(tiny.len(), 5);
    let mut types = std::collections::BTreeSet::new();
    for (file, want) in tiny {
        check_against_reference(&tiny_model(file), want);
        types.extend(want["types"].as_object().unwrap().keys().cloned());
    }
    assert_eq!(types.len(), 14, "13 weight types and F32: {types:?}");
}

#[test]
fn inspect_reports_real_models_as_gguf_py_sees_them() {
    let r = reference();
    let real: Vec<_> = r.iter().filter(|(k, _)| !k.starts_with("tiny-")).collect();
    assert_eq!(real.len(), 3);
    for (file, want) in real {
        check_against_reference(&real_model(file), want);
    }
}

#[test]
fn inspect_real_models_match_the_model_table() {
    // ../shared/models/README.md: shapes as published.
    let q = stdout(&memra(&[
        "inspect",
        real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
            .to_str()
            .unwrap(),
    ]));
    let f = fields(&q);
    assert_eq!(
        (
            f["layers"].as_str(),
            f["embedding"].as_str(),
            f["heads"].as_str(),
            f["kv heads"].as_str()
        ),
        ("24", "896", "14", "2")
    );
    assert!(f["tokenizer"].starts_with("gpt2 (byte-level BPE), pre qwen2, 151936 tokens"));
    let g = stdout(&memra(&[
        "inspect",
        real_model("gemma-3-270m-q4_k_m.gguf").to_str().unwrap(),
    ]));
    let f = fields(&g);
    assert_eq!(
        (
            f["layers"].as_str(),
            f["embedding"].as_str(),
            f["heads"].as_str(),
            f["kv heads"].as_str()
        ),
        ("18", "640", "4", "1")
    );
    assert_eq!(
        (f["head dim (k)"].as_str(), f["sliding window"].as_str()),
        ("256", "512")
    );
    assert!(f["tokenizer"].starts_with("llama (SentencePiece BPE)"));
    assert!(f["tokenizer"].contains("262144 tokens"));
}

#[test]
fn inspect_all_lists_every_key_and_tensor() {
    let out = memra(&[
        "inspect",
        "--all",
        tiny_model("tiny-qwen3moe.gguf").to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let text = stdout(&out);
    let f = memra_gguf::GgufFile::open(tiny_model("tiny-qwen3moe.gguf")).unwrap();
    for (k, _) in f.metadata.iter() {
        assert!(text.contains(&format!("  {k} ")), "key {k}");
    }
    for t in &f.tensors {
        assert!(
            text.contains(&format!("  {:<40} {:<8} ", t.name, t.ty.name())),
            "tensor {}",
            t.name
        );
    }
}

#[test]
fn bad_files_exit_1_with_a_one_line_error() {
    let dir = std::env::temp_dir().join(format!("memra-cli-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Every 5th truncation point keeps the process count moderate; the library test
    // covers every offset.
    let cases = malformed_corpus(5);
    for (i, case) in cases.iter().enumerate() {
        let path = dir.join(format!("case{i}.gguf"));
        std::fs::write(&path, &case.bytes).unwrap();
        let out = memra(&["inspect", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {err}", case.name);
        assert!(out.stdout.is_empty(), "{}: printed to stdout", case.name);
        assert_eq!(err.lines().count(), 1, "{}: {err}", case.name);
        assert!(err.starts_with("error: "), "{}: {err}", case.name);
        assert!(case.message_fits(&err), "{}: {err}", case.name);
    }
    let missing = memra(&["inspect", dir.join("absent.gguf").to_str().unwrap()]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("absent.gguf"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn synth_writes_a_model_inspect_can_read() {
    let dir = std::env::temp_dir().join(format!("memra-cli-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("l1b.gguf");
    let out = memra(&[
        "synth",
        "--shape",
        "llama3-1b",
        "--quant",
        "q4_0",
        "-o",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&memra(&["inspect", path.to_str().unwrap()]));
    let f = fields(&text);
    assert_eq!(
        (
            f["layers"].as_str(),
            f["embedding"].as_str(),
            f["heads"].as_str(),
            f["kv heads"].as_str(),
            f["ffn width"].as_str()
        ),
        ("16", "2048", "32", "8", "8192")
    );
    let table = type_table(&text);
    // 16 layers x 7 matrices + token_embd; output is Q6_K.
    assert_eq!(table["Q4_0"].0, 16 * 7 + 1);
    assert_eq!(table["Q6_K"].0, 1);
    assert_eq!(table["F32"].0, 16 * 2 + 1);

    // The blocks decode to finite, moderate weights.
    let g = memra_gguf::GgufFile::open(&path).unwrap();
    let t = g.tensor("blk.3.ffn_down.weight").unwrap();
    let v = memra_gguf::quant::dequantize_to_vec(t.ty, &g.tensor_data(t)[..18 * 1024]).unwrap();
    assert!(
        v.iter().all(|x| x.is_finite() && x.abs() < 0.02),
        "weights out of range"
    );
    assert!(v.iter().any(|&x| x != 0.0));
    let norm = g.tensor("blk.0.attn_norm.weight").unwrap();
    let n = memra_gguf::quant::dequantize_to_vec(norm.ty, g.tensor_data(norm)).unwrap();
    assert!(n.iter().all(|x| (0.9..=1.1).contains(x)));
    std::fs::remove_dir_all(&dir).unwrap();

    for (shape, quant) in [("llama3-9b", "q4_0"), ("llama3-1b", "q3_k")] {
        let o = memra(&[
            "synth",
            "--shape",
            shape,
            "--quant",
            quant,
            "-o",
            "/dev/null",
        ]);
        assert_eq!(o.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&o.stderr).starts_with("error: unknown"));
    }
}

fn golden(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(
        memra_gguf::test_files::shared_dir()
            .join("golden")
            .join(file),
    )
    .unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn tokenize_ids_print_like_llama_tokenize() {
    let dir = std::env::temp_dir().join(format!("memra-cli-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut checked = 0;
    for case in golden("tokenize.json") {
        let model = real_model(&format!("{}.gguf", case["model"].as_str().unwrap()));
        // The text goes through a file, read verbatim, like llama-tokenize -f.
        let path = dir.join("text.txt");
        std::fs::write(&path, case["text"].as_str().unwrap()).unwrap();
        let mut args = vec![
            "tokenize",
            "-m",
            model.to_str().unwrap(),
            "-f",
            path.to_str().unwrap(),
            "--ids",
        ];
        if !case["parse_special"].as_bool().unwrap() {
            args.push("--no-parse-special");
        }
        let out = memra(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ids: Vec<String> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(stdout(&out), format!("[{}]\n", ids.join(", ")), "{case}");
        checked += 1;
    }
    assert_eq!(checked, 48);

    let qwen = real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let q = qwen.to_str().unwrap();
    let pieces = stdout(&memra(&[
        "tokenize",
        "-m",
        q,
        "-p",
        "Hello world<|im_end|>",
    ]));
    assert_eq!(
        pieces,
        "  9707 -> 'Hello'\n  1879 -> ' world'\n151645 -> '<|im_end|>'\n"
    );

    let bad = dir.join("bad.txt");
    std::fs::write(&bad, b"ok \xff\xfe").unwrap();
    let out = memra(&["tokenize", "-m", q, "-f", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid UTF-8 (bad byte at offset 3)"));
    let out = memra(&["tokenize", "-m", q]);
    assert_eq!(out.status.code(), Some(1), "no input given");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn template_renders_conversations_and_refuses_bad_ones() {
    let dir = std::env::temp_dir().join(format!("memra-cli-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, v: &Value| {
        let p = dir.join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p
    };
    for case in golden("chat_template.json")
        .iter()
        .filter(|c| c["model"].as_str().unwrap().contains("0.5b"))
    {
        let model = real_model(&format!("{}.gguf", case["model"].as_str().unwrap()));
        let messages = write("messages.json", &case["messages"]);
        let mut args = vec![
            "template".to_string(),
            "-m".into(),
            model.to_str().unwrap().into(),
            "--messages".into(),
            messages.to_str().unwrap().into(),
        ];
        if !case["tools"].is_null() {
            args.extend([
                "--tools".into(),
                write("tools.json", &case["tools"]).to_str().unwrap().into(),
            ]);
        }
        if !case["add_generation_prompt"].as_bool().unwrap() {
            args.push("--no-generation-prompt".into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = memra(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout(&out), case["rendered"].as_str().unwrap());
    }

    let gemma = real_model("gemma-3-270m-q4_k_m.gguf");
    let g = gemma.to_str().unwrap();
    let messages = write(
        "m.json",
        &serde_json::json!([{"role": "user", "content": "Hi"}]),
    );
    let m = messages.to_str().unwrap();
    let out = memra(&["template", "-m", g, "--messages", m]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no chat template"));
    let out = memra(&["template", "-m", g, "--messages", m, "--template", "gemma"]);
    assert_eq!(
        stdout(&out),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    );

    let raising = dir.join("raise.jinja");
    std::fs::write(&raising, "{{ raise_exception('roles must alternate') }}").unwrap();
    let out = memra(&[
        "template",
        "-m",
        g,
        "--messages",
        m,
        "--template",
        raising.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("roles must alternate"));
    let not_array = write("obj.json", &serde_json::json!({"role": "user"}));
    let out = memra(&[
        "template",
        "-m",
        g,
        "--messages",
        not_array.to_str().unwrap(),
        "--template",
        "chatml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A copy of a tiny model with one metadata key changed.
/// Each command exits 1 with its message on stderr and nothing on stdout.
fn assert_refused(cases: &[(Vec<&str>, &str)]) {
    for (args, msg) in cases {
        let out = memra(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

fn tiny_with(dir: &Path, key: &str, value: memra_gguf::Value) -> std::path::PathBuf {
    let f = memra_gguf::GgufFile::open(tiny_model("tiny-llama.gguf")).unwrap();
    let mut b = memra_gguf::GgufBuilder::new();
    b.metadata = f.metadata.clone();
    b.metadata.set(key, value);
    b.tensors = f
        .tensors
        .iter()
        .map(|t| memra_gguf::TensorSpec::new(t.name.clone(), t.ty, &t.dims))
        .collect();
    let data: Vec<&[u8]> = f.tensors.iter().map(|t| f.tensor_data(t)).collect();
    let path = dir.join(format!("tiny-{}.gguf", key.replace('.', "-")));
    std::fs::write(&path, b.to_bytes(&data).unwrap()).unwrap();
    path
}

#[test]
fn run_streams_the_completion_to_stdout() {
    let case = golden("tiny/greedy.json")
        .into_iter()
        .find(|c| c["model"] == "tiny-qwen3moe")
        .unwrap();
    let model = tiny_model("tiny-qwen3moe.gguf");
    let n = case["n_predict"].to_string();
    let out = memra(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "-p",
        case["prompt"].as_str().unwrap(),
        "-n",
        &n,
        "--temp",
        "0",
        "-t",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Piped, stdout is exactly the generated text: no newline of ours after it.
    let completion = case["completion"].as_str().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), completion);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tiny-qwen3moe") && err.contains("t/s"),
        "{err}"
    );

    // The prompt from a file, and from standard input (`-f -`): the same text.
    let m = model.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("memra-cli-prompt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("prompt.txt");
    std::fs::write(&file, case["prompt"].as_str().unwrap()).unwrap();
    let args = [
        "run",
        "-m",
        m,
        "-f",
        file.to_str().unwrap(),
        "-n",
        &n,
        "--temp",
        "0",
    ];
    assert_eq!(String::from_utf8_lossy(&memra(&args).stdout), completion);
    let mut child = Command::new(env!("CARGO_BIN_EXE_memra"))
        .args(["run", "-m", m, "-f", "-", "-n", &n, "--temp", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(case["prompt"].as_str().unwrap().as_bytes())
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), completion);
    std::fs::remove_dir_all(&dir).unwrap();

    // Same seed, same text; sampling at temperature 1.
    let sample = |seed: &str| {
        memra(&[
            "run", "-m", m, "-p", "Hello", "-n", "16", "--temp", "1", "--seed", seed,
        ])
        .stdout
    };
    assert_eq!(sample("5"), sample("5"));
}

#[test]
fn run_refuses_bad_requests_clearly() {
    let dir = std::env::temp_dir().join(format!("memra-cli-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = tiny_model("tiny-llama.gguf");
    let m = model.to_str().unwrap();
    let long = "word ".repeat(100);
    let mamba = tiny_with(
        &dir,
        "general.architecture",
        memra_gguf::Value::String("mamba9".into()),
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["run", "-m", m, "-p", &long, "-c", "32"],
            "the context holds 32",
        ),
        (vec!["run", "-m", m, "-p", ""], "prompt is empty"),
        (vec!["run", "-m", m], "no prompt"),
        (vec!["run", "-m", m, "-p", "a", "-f", "x"], "not both"),
        (
            vec!["run", "-m", m, "-f", "/nonexistent/prompt"],
            "cannot read",
        ),
        (
            vec!["run", "-m", m, "-p", "hi", "-n", "0"],
            "-n must be at least 1",
        ),
        (
            vec!["run", "-m", mamba.to_str().unwrap(), "-p", "hi"],
            "unsupported architecture \"mamba9\"",
        ),
        (
            vec!["run", "-m", m, "-p", "hi", "--device", "cuda"],
            "--device cpu",
        ),
        (vec!["run", "-m", m, "-p", "hi", "--top-p", "2"], "top-p"),
        (
            vec!["perplexity", "-m", m, "-f", "/nonexistent/text"],
            "cannot read",
        ),
    ];
    assert_refused(&cases);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perplexity_prints_llama_cpp_final_line() {
    let out = memra(&[
        "perplexity",
        "-m",
        tiny_model("tiny-qwen2.gguf").to_str().unwrap(),
        "-f",
        memra_gguf::test_files::shared_dir()
            .join("golden/texts/GPL-3")
            .to_str()
            .unwrap(),
        "-c",
        "256",
        "--chunks",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout(&out);
    let ppl: f64 = line
        .strip_prefix("Final estimate: PPL = ")
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((ppl - 497.5223).abs() / 497.5223 < 0.02, "{line}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).matches("] ").count(),
        4,
        "a progress line per chunk"
    );
}

#[test]
fn chat_answers_turns_until_exit() {
    use std::io::Write as _;
    let model = tiny_model("tiny-qwen2.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_memra"))
        .args([
            "chat",
            "-m",
            model.to_str().unwrap(),
            "--template",
            "chatml",
            "--temp",
            "0",
            "-n",
            "6",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello\nAnd again\n/exit\nnot read\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("generated:").count(), 2, "two replies: {err}");
    // Without a template the model's own is needed; tiny-qwen2 has none.
    let out = memra(&["chat", "-m", model.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no chat template"));
}

#[test]
fn gpu_commands_fail_cleanly_without_a_gpu() {
    // On a machine without GPU (CI) these must say so and exit 1, never panic; on a GPU
    // machine they succeed.
    let model = tiny_model("tiny-llama.gguf");
    for args in [
        vec!["probe"],
        vec![
            "bench",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "0",
            "-n",
            "2",
            "-r",
            "1",
            "--device",
            "cuda",
        ],
    ] {
        let out = memra(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => {}
            Some(1) => assert!(
                err.lines().last().is_some_and(|l| l.starts_with("error: ")),
                "{args:?}: {err}"
            ),
            other => panic!("{args:?}: exit {other:?}: {err}"),
        }
    }
}

/// `run --json-schema FILE` and `--grammar FILE` on the tiny llama (random weights, so
/// only the grammar makes the output what it is): the JSON matches the schema, the GBNF
/// and Lark grammars' outputs are in their languages, each ends by its grammar; bad
/// schemas and grammars exit 1 naming the problem.
#[test]
fn run_holds_the_output_to_a_schema_or_grammar() {
    let dir = std::env::temp_dir().join(format!("memra-cli-grammar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = tiny_model("tiny-llama.gguf");
    let m = model.to_str().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let schema = file(
        "schema.json",
        r#"{"type": "object", "properties": {"ok": {"type": "boolean"},
            "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"], "additionalProperties": false}"#,
    );
    let gbnf = file("yes.gbnf", "root ::= (\"yes\" | \"no\") \"!\"\n");
    let lark = file("digits.lark", "start: /[0-9]{2}/ \"%\"\n");
    let run = |flag: &str, path: &str| {
        memra(&[
            "run", "-m", m, "-p", "Hello", "-n", "40", "--temp", "0.9", "--seed", "3", flag, path,
        ])
    };
    let out = run("--json-schema", &schema);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert!(
        v["ok"].is_boolean() && [1, 2, 3].contains(&v["n"].as_i64().unwrap()),
        "{v}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("stop: EndOfGeneration"));
    let out = run("--grammar", &gbnf);
    assert!(
        ["yes!", "no!"].contains(&stdout(&out).as_str()),
        "{}",
        stdout(&out)
    );
    let out = run("--grammar", &lark);
    let text = stdout(&out);
    assert!(
        text.len() == 3 && text.ends_with('%') && text[..2].chars().all(|c| c.is_ascii_digit()),
        "{text}"
    );
    let bad_schema = file("bad.json", r#"{"type": "strin"}"#);
    let bad_gbnf = file("bad.gbnf", "item ::= \"a\"\n");
    for (flag, path, msg) in [
        ("--json-schema", bad_schema.as_str(), "strin"),
        ("--grammar", bad_gbnf.as_str(), "root"),
        ("--json-schema", gbnf.as_str(), "is not JSON"),
        ("--grammar", "/nonexistent/g.lark", "cannot read"),
    ] {
        let out = run(flag, path);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flag} {path}: {err}");
        assert!(err.contains(msg), "{flag} {path}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `memra run` greedy on a tiny model on `device` with `args` added: success, stdout and
/// stderr.
fn run_tiny(model: &str, device: &str, args: &[&str]) -> (bool, String, String) {
    let m = tiny_model(model);
    let mut all = vec!["run", "-m", m.to_str().unwrap(), "-p", "hello", "-n", "12"];
    all.extend_from_slice(&["--temp", "0", "--device", device]);
    all.extend_from_slice(args);
    let o = memra(&all);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    (o.status.success(), stdout(&o), err)
}

#[test]
fn tensor_parallel_on_the_cpu_generates_what_one_rank_does() {
    let (ok, one, err) = run_tiny("tiny-qwen3.gguf", "cpu", &[]);
    assert!(ok, "{err}");
    let (ok, two, err) = run_tiny("tiny-qwen3.gguf", "cpu", &["-tp", "2"]);
    assert!(ok, "{err}");
    assert!(err.contains("split over 2 tensor-parallel ranks"), "{err}");
    assert!(!one.is_empty());
    assert_eq!(one, two);
}

#[test]
fn tensor_and_pipeline_parallel_refuse_what_they_cannot_do() {
    let refused = |model: &str, device: &str, args: &[&str], want: &str| {
        let (ok, _, err) = run_tiny(model, device, args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    };
    let q = "tiny-qwen3.gguf";
    refused(
        "tiny-gemma3.gguf",
        "cpu",
        &["-tp", "2"],
        "1 KV heads do not split over 2 ranks",
    );
    refused(
        "tiny-llama.gguf",
        "cpu",
        &["-tp", "2"],
        "would cut its quant blocks",
    );
    refused(q, "cpu", &["--tensor-parallel", "0"], "at least 1");
    refused(q, "cpu", &["--pipeline-parallel", "3"], "takes 1 or 2");
    refused(q, "cpu", &["--pipeline-parallel", "2"], "over GPUs");
    // The CI's machines have fewer than 2 GPUs (or no driver: 0).
    let gpus = "needs 2 GPUs; this machine has";
    refused(q, "cuda", &["-tp", "2"], gpus);
    refused(q, "cuda", &["--pipeline-parallel", "2"], gpus);
}

/// `bench --spec-prompts FILE` on the tiny llama with prompt lookup: every prompt's
/// speculative output equals its plain one, the drafts' counts add up, the JSON report
/// holds a row a prompt; without drafting, or with a bad prompts file, exit 1 naming why.
#[test]
fn bench_spec_prompts_compares_speculation_with_plain_decoding() {
    let dir = std::env::temp_dir().join(format!("memra-cli-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = tiny_model("tiny-llama.gguf");
    let m = model.to_str().unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "\"def add(a, b):\\n    return a + b\\n\\ndef add(a, b):\\n\"\n\n{\"prompt\": \"one two three one two\"}\n",
    )
    .unwrap();
    let p = prompts.to_str().unwrap();
    let bench = |file: &str, n: &str, extra: &[&str]| {
        let mut args = vec!["bench", "-m", m, "--spec-prompts", file, "-n", n];
        // The length rule drafts whatever the lookup finds (the cost rule may not, here).
        args.extend(["--device", "cpu", "--draft-policy", "length"]);
        args.extend_from_slice(extra);
        memra(&args)
    };
    let out = bench(p, "12", &["--spec-ngram", "2", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    let rows = v["prompts"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let (mut drafted, mut accepted) = (0, 0);
    for r in rows {
        assert_eq!(r["same"], Value::Bool(true), "{r}");
        assert_eq!(r["generated"].as_u64(), Some(12), "{r}");
        let (d, a) = (
            r["draft_tokens"].as_u64().unwrap(),
            r["accepted_tokens"].as_u64().unwrap(),
        );
        assert!(a <= d, "{r}");
        drafted += d;
        accepted += a;
    }
    assert!(drafted > 0, "prompt lookup drafted nothing: {v}");
    let rate = v["acceptance"].as_f64().unwrap();
    assert!((rate - accepted as f64 / drafted as f64).abs() < 1e-9);
    assert!(v["speedup"].as_f64().unwrap() > 0.0);
    // The markdown table: a row a prompt and the total.
    let md = bench(p, "6", &["--spec-ngram", "2"]);
    assert!(md.status.success());
    let table = stdout(&md);
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| ")).count(),
        5,
        "{table}"
    );
    // Bad uses.
    let bad = dir.join("bad.jsonl");
    for (content, extra, want) in [
        (
            "\"a prompt\"\n",
            None,
            "give --spec-ngram N or --model-draft FILE",
        ),
        (
            "[1, 2]\n",
            Some("--spec-ngram"),
            "bad.jsonl:1: neither a string nor an object",
        ),
        (
            "{\"text\": \"x\"}\n",
            Some("--spec-ngram"),
            "without a \"prompt\" string",
        ),
        ("\n\n", Some("--spec-ngram"), "holds no prompts"),
        (
            "not json\n",
            Some("--spec-ngram"),
            "bad.jsonl:1: not a JSON line",
        ),
    ] {
        std::fs::write(&bad, content).unwrap();
        let flags: &[&str] = match extra {
            Some(flag) => &[flag, "2"],
            None => &[],
        };
        let out = bench(bad.to_str().unwrap(), "4", flags);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{content:?}: {err}");
        assert!(err.contains(want), "{content:?}: {err}");
    }
    let both = memra(&[
        "bench",
        "-m",
        m,
        "--spec-prompts",
        p,
        "--batched",
        "--spec-ngram",
        "2",
    ]);
    assert!(!both.status.success());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn embed_prints_normalized_states_and_refuses_bad_input() {
    let dir = std::env::temp_dir().join(format!("memra-cli-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = tiny_model("tiny-qwen2.gguf");
    let m = model.to_str().unwrap();
    let texts = ["a b c", "hello there, world"];
    let parse = |o: &Output| -> Vec<Vec<f64>> {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        stdout(o)
            .lines()
            .map(|l| l.split(' ').map(|x| x.parse().unwrap()).collect())
            .collect()
    };
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["embed", "-m", m, "-t", "1"].map(String::from).to_vec();
        for t in texts {
            a.extend(["-p".to_string(), t.to_string()]);
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |a: Vec<String>| memra(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let raw = parse(&run(args(&["--embd-normalize", "-1"])));
    let unit = run(args(&[]));
    assert!(String::from_utf8_lossy(&unit.stderr).contains("cosine similarity"));
    let unit = parse(&unit);
    assert_eq!((raw.len(), unit.len()), (2, 2));
    for (r, u) in raw.iter().zip(&unit) {
        assert!(r.len() > 8 && r.len() == u.len());
        let n = r.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((n - 1.0).abs() > 1e-3, "the raw state is not a unit vector");
        for (x, y) in r.iter().zip(u) {
            assert!((x / n - y).abs() < 1e-6, "{x} / {n} against {y}");
        }
    }
    assert!(raw[0] != raw[1], "two texts, two states");
    // JSON, and the texts from a file, give the same vectors.
    let json: Value = serde_json::from_str(&stdout(&run(args(&["--json"])))).unwrap();
    let data = json["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (d, u) in data.iter().zip(&unit) {
        let v: Vec<f64> = d["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(v.iter().zip(u).all(|(a, b)| (a - b).abs() < 1e-6));
    }
    let file = dir.join("texts.txt");
    std::fs::write(&file, format!("{}\n\n{}\n", texts[0], texts[1])).unwrap();
    let from_file = parse(&memra(&[
        "embed",
        "-m",
        m,
        "-t",
        "1",
        "-f",
        file.to_str().unwrap(),
    ]));
    assert_eq!(from_file, unit);
    // Refusals: nothing to embed, a bad norm, a text over the context, a GPU, a model
    // whose attention is not causal.
    let bidirectional = tiny_with(
        &dir,
        "llama.attention.causal",
        memra_gguf::Value::Bool(false),
    );
    let long = "word ".repeat(100);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["embed", "-m", m], "nothing to embed"),
        (
            vec!["embed", "-m", m, "-p", "x", "--embd-normalize", "99"],
            "--embd-normalize",
        ),
        (
            vec!["embed", "-m", m, "-p", &long, "-c", "32"],
            "the context holds 32",
        ),
        (
            vec!["embed", "-m", m, "-p", "x", "--device", "cuda"],
            "--device cpu",
        ),
        (
            vec!["embed", "-m", bidirectional.to_str().unwrap(), "-p", "x"],
            "attention is not causal",
        ),
    ];
    assert_refused(&cases);
    std::fs::remove_dir_all(&dir).unwrap();
}
