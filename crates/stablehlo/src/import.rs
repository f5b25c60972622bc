//! Imports a StableHLO module made elsewhere (a JAX kernel from `jax.export`, printed in
//! MLIR's generic form) as private functions that our programs call like an op's fragment.
//!
//! The module's functions are renamed into a namespace (`prefix`), made private, and lose
//! their argument/result attributes (sharding, layout and result-info annotations only JAX
//! reads; donation is decided by the runtime). Anything else at the module's top level
//! (a Shardy mesh) is dropped. The text is scanned, not reparsed: only string literals,
//! bracket nesting and `@symbol` references matter for renaming.

use std::collections::HashMap;

use crate::{DType, TensorType};

/// An imported module.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The renamed functions, ready to follow `@main` in a module.
    pub text: String,
    /// The renamed entry function (the module's public `main`).
    pub entry: String,
    pub inputs: Vec<TensorType>,
    pub outputs: Vec<TensorType>,
    /// `call_target_name` of each custom call in the module (the plugin must know them).
    pub custom_calls: Vec<String>,
}

/// Imports the generic-form module `text`, its functions renamed `{prefix}_{name}`.
pub fn import(text: &str, prefix: &str) -> Result<Imported, String> {
    let body = module_body(text)?;
    let ops = top_level_ops(body)?;
    let mut funcs = Vec::new();
    let mut renames = HashMap::new();
    for op in &ops {
        match op_name(op) {
            Some("func.func") => {
                let f = parse_func(op)?;
                renames.insert(f.name.clone(), format!("{prefix}_{}", f.name));
                funcs.push(f);
            }
            // A device mesh for sharding annotations, which one device does not need.
            Some("sdy.mesh") => {}
            Some(other) => {
                return Err(format!(
                    "the module has a top-level `{other}`; only functions can be imported"
                ))
            }
            None => return Err(format!("cannot read the module near `{}`", snippet(op))),
        }
    }
    let main = funcs
        .iter()
        .find(|f| f.name == "main" && f.public)
        .ok_or("the module has no public `main` function")?;
    let (inputs, outputs) = parse_function_type(&main.function_type)?;
    let mut out = String::new();
    let mut custom_calls = Vec::new();
    for f in &funcs {
        let body = rename_symbols(f.rest, &renames);
        collect_custom_calls(&body, &mut custom_calls);
        out.push_str(&format!(
            "  \"func.func\"() <{{function_type = {}, sym_name = \"{}\", sym_visibility = \"private\"}}> {} : () -> ()\n",
            f.function_type, renames[&f.name], body
        ));
    }
    Ok(Imported {
        text: out,
        entry: renames["main"].clone(),
        inputs,
        outputs,
        custom_calls,
    })
}

struct Func<'a> {
    name: String,
    public: bool,
    function_type: String,
    /// Its region (the body).
    rest: &'a str,
}

fn snippet(s: &str) -> String {
    s.trim().chars().take(60).collect()
}

/// Index of the end of the string literal starting at `start` (an opening quote).
fn string_end(s: &[u8], start: usize) -> Result<usize, String> {
    let mut i = start + 1;
    while i < s.len() {
        match s[i] {
            b'\\' => i += 2,
            b'"' => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err("unterminated string literal in the module".into())
}

/// How the byte at `i` changes the bracket depth: `(`, `[`, `{` open, their pairs close;
/// `<`/`>` count only with `angles` (types), and `->` is an arrow.
fn bracket(s: &[u8], i: usize, angles: bool) -> i32 {
    match s[i] {
        b'(' | b'[' | b'{' => 1,
        b')' | b']' | b'}' => -1,
        b'<' if angles => 1,
        b'>' if angles && !(i > 0 && s[i - 1] == b'-') => -1,
        _ => 0,
    }
}

/// Index just past the bracket closing the one at `open` (`(`, `[`, `{` or `<`), skipping
/// string literals. `<` counts only with `angles`.
fn close(s: &[u8], open: usize, angles: bool) -> Result<usize, String> {
    let mut depth = 0i32;
    let mut i = open;
    while i < s.len() {
        match s[i] {
            b'"' => {
                i = string_end(s, i)?;
                continue;
            }
            _ => depth += bracket(s, i, angles),
        }
        i += 1;
        if depth == 0 {
            return Ok(i);
        }
    }
    Err("unbalanced brackets in the module".into())
}

/// The ops inside `"builtin.module"() ... ({ ... })` (or the pretty `module { ... }`).
fn module_body(text: &str) -> Result<&str, String> {
    let s = text.as_bytes();
    let start = text
        .find("\"builtin.module\"")
        .ok_or("expected a module printed in MLIR's generic form (\"builtin.module\")")?;
    let open = text[start..]
        .find("({")
        .map(|i| start + i + 1)
        .ok_or("the module has no body")?;
    let end = close(s, open, false)?;
    Ok(&text[open + 1..end - 1])
}

/// Splits a region body into its top-level ops (an op ends at a newline outside brackets).
fn top_level_ops(body: &str) -> Result<Vec<&str>, String> {
    let s = body.as_bytes();
    let mut ops = Vec::new();
    let (mut i, mut start, mut depth) = (0usize, 0usize, 0i32);
    while i < s.len() {
        match s[i] {
            b'"' => {
                i = string_end(s, i)?;
                continue;
            }
            b'\n' if depth == 0 => {
                if !body[start..i].trim().is_empty() {
                    ops.push(body[start..i].trim());
                }
                start = i + 1;
            }
            _ => depth += bracket(s, i, false),
        }
        i += 1;
    }
    if !body[start..].trim().is_empty() {
        ops.push(body[start..].trim());
    }
    Ok(ops)
}

fn op_name(op: &str) -> Option<&str> {
    let op = op.strip_prefix('"')?;
    Some(&op[..op.find('"')?])
}

/// Splits `k = v, k = v` at top-level commas.
fn entries(dict: &str) -> Result<Vec<(&str, &str)>, String> {
    let s = dict.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut start) = (0usize, 0usize);
    fn push<'a>(out: &mut Vec<(&'a str, &'a str)>, part: &'a str) {
        let part = part.trim();
        match part.split_once('=') {
            _ if part.is_empty() => {}
            Some((k, v)) => out.push((k.trim(), v.trim())),
            None => out.push((part, "")),
        }
    }
    while i < s.len() {
        match s[i] {
            b'"' => {
                i = string_end(s, i)?;
                continue;
            }
            b'(' | b'[' | b'{' | b'<' => {
                i = close(s, i, true)?;
                continue;
            }
            b',' => {
                push(&mut out, &dict[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    push(&mut out, &dict[start..]);
    Ok(out)
}

fn unquote(v: &str) -> Result<String, String> {
    let v = v.trim();
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .map(str::to_string)
        .ok_or_else(|| format!("expected a string, found `{}`", snippet(v)))
}

/// `"func.func"() <{props}> ({region}) {attrs} : () -> ()`: its name, visibility, type and
/// the text from the region on (the attribute dictionary after it dropped).
fn parse_func(op: &str) -> Result<Func<'_>, String> {
    let s = op.as_bytes();
    let after_name = "\"func.func\"()".len();
    let rest = op[after_name..].trim_start();
    let off = op.len() - rest.len();
    // Inherent attributes print as properties `<{...}>` (newer MLIR) or a dictionary.
    let (dict, mut i) = if rest.starts_with("<{") {
        let end = close(s, off + 1, false)?;
        (&op[off + 2..end - 1], end + 1)
    } else if rest.starts_with('{') {
        let end = close(s, off, false)?;
        (&op[off + 1..end - 1], end)
    } else {
        return Err(format!("cannot read the function `{}`", snippet(op)));
    };
    let mut name = None;
    let mut public = true;
    let mut function_type = None;
    for (k, v) in entries(dict)? {
        match k {
            "sym_name" => name = Some(unquote(v)?),
            "sym_visibility" => public = unquote(v)? == "public",
            "function_type" => function_type = Some(v.to_string()),
            _ => {}
        }
    }
    let name = name.ok_or("a function without sym_name")?;
    let function_type = function_type.ok_or_else(|| format!("function {name} has no type"))?;
    while i < s.len() && s[i] == b' ' {
        i += 1;
    }
    if !op[i..].starts_with("({") {
        return Err(format!(
            "function {name} has no body (declarations are not supported)"
        ));
    }
    // The discardable attributes after the region are dropped with it.
    let region_end = close(s, i, false)?;
    Ok(Func {
        name,
        public,
        function_type,
        rest: &op[i..region_end],
    })
}

/// `(t, t) -> (t, t)` or `(t) -> t` into input and output types.
fn parse_function_type(ft: &str) -> Result<(Vec<TensorType>, Vec<TensorType>), String> {
    let s = ft.as_bytes();
    let ins_end = close(s, 0, true)?;
    let ins = types(&ft[1..ins_end - 1])?;
    let rest = ft[ins_end..].trim_start();
    let rest = rest
        .strip_prefix("->")
        .ok_or_else(|| format!("cannot read the function type `{ft}`"))?
        .trim();
    let outs = if rest.starts_with('(') {
        types(&rest[1..rest.len() - 1])?
    } else {
        types(rest)?
    };
    Ok((ins, outs))
}

fn types(list: &str) -> Result<Vec<TensorType>, String> {
    let s = list.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut start) = (0usize, 0usize);
    while i <= s.len() {
        if i == s.len() || s[i] == b',' {
            let t = list[start..i].trim();
            if !t.is_empty() {
                out.push(tensor_type(t)?);
            }
            start = i + 1;
            i += 1;
            continue;
        }
        if s[i] == b'<' {
            i = close(s, i, true)?;
            continue;
        }
        i += 1;
    }
    Ok(out)
}

/// `tensor<4x8xf32>` (static shapes only).
pub fn tensor_type(t: &str) -> Result<TensorType, String> {
    let inner = t
        .strip_prefix("tensor<")
        .and_then(|x| x.strip_suffix('>'))
        .ok_or_else(|| format!("unsupported type `{t}` (only tensors)"))?;
    if inner.contains(',') {
        return Err(format!(
            "unsupported type `{t}` (encodings and bounds are not supported)"
        ));
    }
    let mut dims = Vec::new();
    let mut elem = inner;
    // Dimensions are `NUMx` prefixes; the element type itself may contain no `x` digit run.
    while let Some((d, rest)) = elem.split_once('x') {
        if d == "?" {
            return Err(format!(
                "`{t}` has a dynamic dimension; kernels must have static shapes"
            ));
        }
        match d.parse::<i64>() {
            Ok(n) => {
                dims.push(n);
                elem = rest;
            }
            Err(_) => break,
        }
    }
    let dtype =
        dtype_of(elem).ok_or_else(|| format!("unsupported element type `{elem}` in `{t}`"))?;
    Ok(TensorType::new(dtype, &dims))
}

/// The dtype printed as `mlir` (see `DType::mlir`).
pub fn dtype_of(mlir: &str) -> Option<DType> {
    use DType::*;
    [
        Bool, U8, I8, I16, I32, I64, U32, U64, F16, BF16, F32, F64, C64, C128,
    ]
    .into_iter()
    .find(|d| d.mlir() == mlir)
}

/// Replaces `@name` references (outside string literals) by their new names.
fn rename_symbols(text: &str, renames: &HashMap<String, String>) -> String {
    let s = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 64);
    let (mut i, mut copied) = (0usize, 0usize);
    let ident = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.' | b'-');
    while i < s.len() {
        match s[i] {
            b'"' => i = string_end(s, i).unwrap_or(s.len()),
            b'@' => {
                let start = i + 1;
                let (name, end) = if s.get(start) == Some(&b'"') {
                    let end = string_end(s, start).unwrap_or(s.len());
                    (text[start + 1..end - 1].to_string(), end)
                } else {
                    let mut end = start;
                    while end < s.len() && ident(s[end]) {
                        end += 1;
                    }
                    (text[start..end].to_string(), end)
                };
                if let Some(new) = renames.get(&name) {
                    out.push_str(&text[copied..i]);
                    out.push('@');
                    out.push_str(new);
                    copied = end;
                }
                i = end;
            }
            _ => i += 1,
        }
    }
    out.push_str(&text[copied..]);
    out
}

fn collect_custom_calls(text: &str, out: &mut Vec<String>) {
    let key = "call_target_name = \"";
    let mut rest = text;
    while let Some(p) = rest.find(key) {
        rest = &rest[p + key.len()..];
        if let Some(end) = rest.find('"') {
            let name = rest[..end].to_string();
            if !out.contains(&name) {
                out.push(name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &str = r#""builtin.module"() <{sym_name = "jit_f"}> ({
  "func.func"() <{function_type = (tensor<4x8xf32>, tensor<i32>) -> (tensor<4x8xf32>, tensor<f32>), res_attrs = [{jax.result_info = "result['a']"}, {jax.result_info = "@main"}], sym_name = "main", sym_visibility = "public"}> ({
  ^bb0(%arg1: tensor<4x8xf32>, %arg2: tensor<i32>):
    %1 = "stablehlo.constant"() <{value = dense<0.000000e+00> : tensor<f32>}> : () -> tensor<f32>
    %15 = "func.call"(%arg1) <{callee = @g}> : (tensor<4x8xf32>) -> tensor<4x8xf32>
    "func.return"(%15, %1) : (tensor<4x8xf32>, tensor<f32>) -> ()
  }) : () -> ()
  "func.func"() <{function_type = (tensor<4x8xf32>) -> tensor<4x8xf32>, sym_name = "g", sym_visibility = "private"}> ({
  ^bb0(%arg0: tensor<4x8xf32>):
    %0 = "stablehlo.custom_call"(%arg0) <{call_target_name = "foo"}> : (tensor<4x8xf32>) -> tensor<4x8xf32>
    "func.return"(%0) : (tensor<4x8xf32>) -> ()
  }) {jax.x = 1} : () -> ()
}) {mhlo.num_partitions = 1 : i32} : () -> ()
"#;

    #[test]
    fn renames_functions_and_reads_the_signature() {
        let m = import(MODULE, "k_ab").unwrap();
        assert_eq!(m.entry, "k_ab_main");
        assert_eq!(
            m.inputs,
            vec![
                TensorType::new(DType::F32, &[4, 8]),
                TensorType::new(DType::I32, &[])
            ]
        );
        assert_eq!(
            m.outputs,
            vec![
                TensorType::new(DType::F32, &[4, 8]),
                TensorType::new(DType::F32, &[])
            ]
        );
        assert!(m.text.contains("callee = @k_ab_g"), "{}", m.text);
        assert!(m.text.contains("sym_name = \"k_ab_main\""));
        assert!(!m.text.contains("public"));
        assert!(!m.text.contains("jax."), "{}", m.text);
        assert_eq!(m.custom_calls, vec!["foo".to_string()]);
        assert_eq!(m.text.matches("\"func.func\"").count(), 2);
    }

    #[test]
    fn refuses_dynamic_shapes_and_non_modules() {
        let dynamic = MODULE.replace(
            "(tensor<4x8xf32>, tensor<i32>) ->",
            "(tensor<?x8xf32>, tensor<i32>) ->",
        );
        assert!(import(&dynamic, "k")
            .unwrap_err()
            .contains("dynamic dimension"));
        assert!(import("module {}", "k")
            .unwrap_err()
            .contains("generic form"));
        let no_main = MODULE.replace("sym_name = \"main\"", "sym_name = \"other\"");
        assert!(import(&no_main, "k")
            .unwrap_err()
            .contains("no public `main`"));
    }

    #[test]
    fn reads_element_types() {
        assert_eq!(
            tensor_type("tensor<2x3xi1>").unwrap(),
            TensorType::new(DType::Bool, &[2, 3])
        );
        assert_eq!(
            tensor_type("tensor<5xcomplex<f32>>").unwrap(),
            TensorType::new(DType::C64, &[5])
        );
        assert_eq!(
            tensor_type("tensor<bf16>").unwrap(),
            TensorType::new(DType::BF16, &[])
        );
        assert!(tensor_type("tensor<4xf8E4M3FN>").is_err());
    }
}
