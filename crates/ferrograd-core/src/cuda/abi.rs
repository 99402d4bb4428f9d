//! The Rust <-> CUDA contract, checked: the op codes of `src/op.rs` against the `.cu` enums
//! (`enum FgBinaryOp { FG_ADD = 0, ... }`) and against docs/kernel-abi.md, and every kernel entry
//! point against the document. A change on one side without the other fails here, not on a GPU.

use super::modules::{headers, ALL};
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryCode};
use std::collections::BTreeMap;

const ABI_DOC: &str = include_str!("../../../../docs/kernel-abi.md");

/// A Rust op enum as (variant name, value) pairs.
type Codes = Vec<(String, i32)>;

fn codes<T: std::fmt::Debug + Copy>(all: &[T], value: impl Fn(T) -> i32) -> Codes {
    all.iter().map(|&v| (format!("{v:?}"), value(v))).collect()
}

/// Every Rust enum the kernels switch on, by the name of its `.cu` twin.
fn rust_enums() -> BTreeMap<&'static str, (&'static str, Codes)> {
    BTreeMap::from([
        ("FgUnaryOp", ("UnaryCode", codes(&UnaryCode::ALL, |v| v as i32))),
        ("FgBinaryOp", ("BinaryOp", codes(&BinaryOp::ALL, |v| v as i32))),
        ("FgCmpOp", ("CmpOp", codes(&CmpOp::ALL, |v| v as i32))),
        ("FgReduceOp", ("ReduceOp", codes(&ReduceOp::ALL, |v| v as i32))),
        ("FgArgReduceOp", ("ArgReduceOp", codes(&ArgReduceOp::ALL, |v| v as i32))),
        ("FgIndexOp", ("IndexOp", codes(&super::error_flag::IndexOp::ALL, |v| v as i32))),
    ])
}

/// `GeluTanhGrad` -> `FG_GELU_TANH_GRAD`: the rule every `.cu` enumerator follows.
fn c_name(variant: &str) -> String {
    let mut out = String::from("FG_");
    for (i, ch) in variant.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

/// Every named `enum Fg... { A = 0, B, ... };` in the kernel sources, values resolved.
fn cu_enums() -> BTreeMap<String, Vec<(String, i32)>> {
    let mut out = BTreeMap::new();
    // A source built as several modules (parts) is read once.
    let mut texts: Vec<&str> = ALL.iter().map(|m| m.src).chain(headers::ALL.iter().map(|h| h.src)).collect();
    texts.sort_unstable();
    texts.dedup();
    for text in texts {
        let mut rest = text;
        while let Some(i) = rest.find("enum Fg") {
            let after = &rest[i + "enum ".len()..];
            let (name, body) = after.split_once('{').expect("enum body");
            let (body, tail) = body.split_once('}').expect("enum end");
            let mut next = 0;
            let entries: Vec<(String, i32)> = body
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(|e| {
                    let (n, v) = match e.split_once('=') {
                        Some((n, v)) => (n.trim(), v.trim().parse::<i32>().expect("enum value")),
                        None => (e, next),
                    };
                    next = v + 1;
                    (n.to_string(), v)
                })
                .collect();
            assert!(out.insert(name.trim().to_string(), entries).is_none(), "enum {name} defined twice");
            rest = tail;
        }
    }
    out
}

#[test]
fn cu_enums_equal_the_rust_enums() {
    let cu = cu_enums();
    let rust = rust_enums();
    for (cu_name, (rust_name, variants)) in &rust {
        let got = cu.get(*cu_name).unwrap_or_else(|| panic!("no `enum {cu_name}` in the kernels ({rust_name})"));
        let want: Vec<(String, i32)> = variants.iter().map(|(n, v)| (c_name(n), *v)).collect();
        assert_eq!(got, &want, "{cu_name} in the kernels differs from {rust_name} in Rust");
    }
    for name in cu.keys() {
        assert!(rust.contains_key(name.as_str()), "`enum {name}` in the kernels has no Rust twin in this test");
    }
}

/// The op-code lines of docs/kernel-abi.md: `- UnaryOp: Neg 0, Abs 1, ...` (a parenthesis after a
/// value explains it and is skipped).
fn doc_codes(enum_name: &str) -> Vec<(String, i32)> {
    let prefix = format!("- {enum_name}: ");
    let mut text = String::new();
    let mut lines = ABI_DOC.lines().skip_while(|l| !l.starts_with(&prefix));
    if let Some(first) = lines.next() {
        text.push_str(&first[prefix.len()..]);
        for l in lines.take_while(|l| l.starts_with("  ")) {
            text.push(' ');
            text.push_str(l.trim());
        }
    }
    // Drop parenthesised remarks, then read `Name value` pairs.
    let mut plain = String::new();
    let mut depth = 0;
    for ch in text.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ if depth == 0 => plain.push(ch),
            _ => {}
        }
    }
    plain
        .split(',')
        .filter_map(|p| {
            let mut w = p.split_whitespace();
            let (n, v) = (w.next()?, w.next()?);
            Some((n.to_string(), v.trim_end_matches('.').parse().ok()?))
        })
        .collect()
}

#[test]
fn kernel_abi_doc_lists_every_op_code() {
    for (rust_name, variants) in rust_enums().into_values() {
        assert_eq!(doc_codes(rust_name), variants, "docs/kernel-abi.md's {rust_name} line differs from src/op.rs");
    }
}

/// `softmax_##SUF(` -> `softmax`, `adam_f32(` -> `adam`: an entry point's family name.
fn family(kernel: &str) -> &str {
    let base = kernel.split("_##").next().unwrap_or(kernel);
    for suffix in ["_f32", "_f64", "_f16", "_bf16", "_i32", "_u32", "_u8", "_i8"] {
        if let Some(b) = base.strip_suffix(suffix) {
            return b;
        }
    }
    base
}

/// The text after each kernel declaration's `__global__ void` (and its own `__launch_bounds__`):
/// `FG_KERNEL name(`, or `extern "C" __global__ void __launch_bounds__(NT) name(` in the kernels
/// that set their own bounds (attention, selective scan).
fn kernel_decls(src: &str) -> Vec<&str> {
    fn skip(t: &str) -> &str {
        t.trim_start_matches(|c: char| c.is_whitespace() || c == '\\')
    }
    let mut decls: Vec<&str> = src.split("FG_KERNEL ").skip(1).collect();
    for decl in src.split("extern \"C\" __global__ void").skip(1) {
        let mut t = skip(decl);
        if let Some(rest) = t.strip_prefix("__launch_bounds__(") {
            t = skip(rest.split_once(')').map_or("", |(_, after)| after));
        }
        decls.push(t);
    }
    decls
}

#[test]
fn kernel_abi_doc_names_every_kernel() {
    for m in ALL {
        for decl in kernel_decls(m.src) {
            // A name built by a macro (`FG_ATTN_NAME(fg_attn_dq_d, FG_ATTN_D, SUF)`) is its stem,
            // documented as `fg_attn_dq_d{D}_...`.
            let name = match decl.split_once('(') {
                Some((head, args)) if head.starts_with("FG_") => args.split([',', ')']).next().unwrap_or("").trim(),
                _ => decl.split(['(', ' ']).next().unwrap_or(""),
            };
            let fam = family(name);
            assert!(
                ["_", "(", "{"].iter().any(|c| ABI_DOC.contains(&format!("`{fam}{c}"))),
                "docs/kernel-abi.md does not document `{fam}` (module {})",
                m.name
            );
        }
    }
}

#[test]
fn the_parsers_read_what_they_should() {
    assert_eq!(c_name("GeluTanhGrad"), "FG_GELU_TANH_GRAD");
    assert_eq!(c_name("Eq"), "FG_EQ");
    assert_eq!(family("softmax_rows_##SUF"), "softmax_rows");
    assert_eq!(family("reduce_acc_f32"), "reduce_acc");
    let own = "extern \"C\" __global__ void __launch_bounds__(NT) fg_sscan_fwd_##NT##x##K##_##SUF(";
    assert_eq!(
        kernel_decls(own).iter().map(|d| family(d.split('(').next().unwrap_or(""))).collect::<Vec<_>>(),
        ["fg_sscan_fwd"]
    );
    let unary = doc_codes("UnaryCode");
    assert!(unary.len() >= 20 && unary[0] == ("Neg".to_string(), 0), "{unary:?}");
    assert!(cu_enums().contains_key("FgUnaryOp"));
}
