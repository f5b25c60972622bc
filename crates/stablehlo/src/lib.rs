//! An in-memory StableHLO function builder that prints MLIR text for PJRT.
//!
//! Every op is printed in MLIR's generic form (`"stablehlo.add"(%a, %b) : (...) -> ...`),
//! which is stable across StableHLO versions and needs no per-op printer. Typed helpers
//! (`add`, `broadcast_in_dim`, `reduce`, ...) compute result types so lowering rules never
//! spell a type by hand.

use std::fmt::Write;
use std::sync::Arc;

mod collectives;
pub mod import;
mod ops;
pub use ops::{CmpDir, ReduceKind, ScatterDims};

/// Element types, named as PyTorch names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
    /// complex64: (real, imag) float32 pairs.
    C64,
    /// complex128: (real, imag) float64 pairs.
    C128,
}

impl DType {
    pub fn mlir(self) -> &'static str {
        match self {
            DType::Bool => "i1",
            DType::U8 => "ui8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "ui32",
            DType::U64 => "ui64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::C64 => "complex<f32>",
            DType::C128 => "complex<f64>",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }
    pub fn is_complex(self) -> bool {
        matches!(self, DType::C64 | DType::C128)
    }
    /// The dtype of a complex type's parts (float32 for complex64); others are their own.
    pub fn real_part(self) -> DType {
        match self {
            DType::C64 => DType::F32,
            DType::C128 => DType::F64,
            d => d,
        }
    }
    /// The complex type whose parts are this float type (complex64 for float32 and the
    /// half types, as PyTorch's `toComplexType` for the types the device has).
    pub fn complex_of(self) -> DType {
        match self {
            DType::F64 | DType::C128 => DType::C128,
            _ => DType::C64,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::U32 | DType::U64
        )
    }
    pub fn is_signed_int(self) -> bool {
        matches!(self, DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }
    /// Prints a Rust number as an MLIR literal of this type.
    pub fn literal(self, v: f64) -> String {
        match self {
            DType::C64 | DType::C128 => {
                let p = self.real_part();
                format!("({}, {})", p.literal(v), p.literal(0.0))
            }
            DType::Bool => (if v != 0.0 { "true" } else { "false" }).to_string(),
            d if d.is_float() => {
                if v.is_nan() {
                    // MLIR spells special floats as hex bit patterns.
                    match d {
                        DType::F16 => "0x7E00".into(),
                        DType::BF16 => "0x7FC0".into(),
                        DType::F32 => "0x7FC00000".into(),
                        _ => "0x7FF8000000000000".into(),
                    }
                } else if v.is_infinite() {
                    let neg = v < 0.0;
                    match (d, neg) {
                        (DType::F16, false) => "0x7C00".into(),
                        (DType::F16, true) => "0xFC00".into(),
                        (DType::BF16, false) => "0x7F80".into(),
                        (DType::BF16, true) => "0xFF80".into(),
                        (DType::F32, false) => "0x7F800000".into(),
                        (DType::F32, true) => "0xFF800000".into(),
                        (_, false) => "0x7FF0000000000000".into(),
                        (_, true) => "0xFFF0000000000000".into(),
                    }
                } else {
                    format!("{v:.17e}")
                }
            }
            _ => format!("{}", v as i64),
        }
    }
    /// A complex literal `(re, im)` of this complex type.
    pub fn complex_literal(self, re: f64, im: f64) -> String {
        let p = self.real_part();
        format!("({}, {})", p.literal(re), p.literal(im))
    }
    pub fn int_literal(self, v: i64) -> String {
        match self {
            DType::Bool => (if v != 0 { "true" } else { "false" }).to_string(),
            d if d.is_float() || d.is_complex() => self.literal(v as f64),
            _ => v.to_string(),
        }
    }
}

/// A ranked tensor type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<i64>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: &[i64]) -> Self {
        TensorType {
            dtype,
            shape: shape.to_vec(),
        }
    }
    pub fn scalar(dtype: DType) -> Self {
        TensorType {
            dtype,
            shape: vec![],
        }
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
    pub fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.shape {
            let _ = write!(s, "{d}x");
        }
        s.push_str(self.dtype.mlir());
        s.push('>');
        s
    }
    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType {
            dtype,
            shape: self.shape.clone(),
        }
    }
}

/// An SSA value of the function being built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(u32);

impl Value {
    /// Creation order within its builder.
    pub fn id(self) -> u32 {
        self.0
    }
}

/// See `Builder::checkpoint`.
#[derive(Clone, Copy, Debug)]
pub struct Checkpoint {
    types: usize,
    params: usize,
    body: usize,
    funcs: usize,
}

/// Builds one `func.func @main`.
pub struct Builder {
    types: Vec<TensorType>,
    params: Vec<Value>,
    /// Stack of line buffers: the bottom one is the function body, the others are regions.
    bodies: Vec<String>,
    /// Parameters whose buffer may be reused for an output: (parameter, output index).
    aliases: Vec<(Value, usize)>,
    /// Functions made elsewhere that the body calls (imported kernels): (name, text),
    /// each name once; printed after `@main`.
    funcs: Vec<(String, Arc<str>)>,
    /// The program's inputs are padded to a bucket (shape buckets, `set_padded`).
    padded: bool,
    /// Values with dims of a real size below their type's (`set_dimension_size`): per dim,
    /// the `i32` scalar holding it.
    real_sizes: std::collections::HashMap<Value, Vec<Option<Value>>>,
}

impl Default for Builder {
    fn default() -> Self {
        Self::new()
    }
}

pub fn i64_array(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    if items.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", items.join(", "))
    }
}

pub fn i64_list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(", "))
}

impl Builder {
    pub fn new() -> Self {
        Builder {
            types: Vec::new(),
            params: Vec::new(),
            bodies: vec![String::new()],
            aliases: Vec::new(),
            funcs: Vec::new(),
            padded: false,
            real_sizes: Default::default(),
        }
    }

    /// A program whose inputs are padded to a bucket, their real sizes set with
    /// `stablehlo.set_dimension_size` (shape buckets). Two things change:
    /// - float sums and products over several dims reduce one dim at a time (`reduce`).
    ///   Padded inputs keep their logical dims, each at most a bucket: XLA:CPU tree-reduces
    ///   only a dim longer than 32 (an exact program's reduction over a flattened input is),
    ///   so a sum over several short dims would add every element in one sequential loop
    ///   (2e-6 relative off over 250 elements);
    /// - element counts (`count`: the divisor of a mean) are the real sizes
    ///   (`set_dimension_size`), not the padded shape's.
    pub fn set_padded(&mut self, on: bool) {
        self.padded = on;
    }

    /// Whether the program's inputs are padded (`set_padded`).
    pub fn padded(&self) -> bool {
        self.padded
    }

    fn fresh(&mut self, ty: TensorType) -> Value {
        self.types.push(ty);
        Value(self.types.len() as u32 - 1)
    }

    pub fn name(v: Value) -> String {
        format!("%v{}", v.0)
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        &self.types[v.0 as usize]
    }

    pub fn shape(&self, v: Value) -> Vec<i64> {
        self.types[v.0 as usize].shape.clone()
    }

    pub fn dtype(&self, v: Value) -> DType {
        self.types[v.0 as usize].dtype
    }

    pub fn rank(&self, v: Value) -> usize {
        self.types[v.0 as usize].shape.len()
    }

    /// A point to roll back to if an op fails half-way through emitting.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            types: self.types.len(),
            params: self.params.len(),
            body: self.bodies[0].len(),
            funcs: self.funcs.len(),
        }
    }

    /// Drops everything emitted since `cp` (only at the top level, outside regions).
    pub fn rollback(&mut self, cp: Checkpoint) {
        self.bodies.truncate(1);
        self.bodies[0].truncate(cp.body);
        self.params.truncate(cp.params);
        self.types.truncate(cp.types);
        self.funcs.truncate(cp.funcs);
        self.real_sizes.retain(|v, _| (v.0 as usize) < cp.types);
    }

    /// Adds a function made elsewhere (an imported kernel's) for the body to call; a name
    /// already added is kept once.
    pub fn add_func(&mut self, name: &str, text: &Arc<str>) {
        if !self.funcs.iter().any(|(n, _)| n == name) {
            self.funcs.push((name.to_string(), text.clone()));
        }
    }

    /// The functions added with `add_func`.
    pub fn funcs(&self) -> &[(String, Arc<str>)] {
        &self.funcs
    }

    /// Lets XLA write output `output` into parameter `param`'s buffer (the caller donates it).
    pub fn alias(&mut self, param: Value, output: usize) {
        self.aliases.push((param, output));
    }

    /// Forgets every `alias`: the next module donates nothing.
    pub fn clear_aliases(&mut self) {
        self.aliases.clear();
    }

    /// The type of the `i`-th parameter.
    pub fn param_type(&self, i: usize) -> &TensorType {
        self.ty(self.params[i])
    }

    /// Position of `v` among the parameters.
    pub fn param_index(&self, v: Value) -> Option<usize> {
        self.params.iter().position(|p| *p == v)
    }

    /// Adds a function parameter.
    pub fn param(&mut self, ty: TensorType) -> Value {
        let v = self.fresh(ty);
        self.params.push(v);
        v
    }

    fn line(&mut self, s: &str) {
        let body = self.bodies.last_mut().expect("builder has a body");
        body.push_str("    ");
        body.push_str(s);
        body.push('\n');
    }

    fn sig(&self, operands: &[Value]) -> String {
        let ins: Vec<String> = operands.iter().map(|v| self.ty(*v).mlir()).collect();
        format!("({})", ins.join(", "))
    }

    /// Emits a generic op with one result.
    pub fn op(&mut self, name: &str, operands: &[Value], attrs: &str, result: TensorType) -> Value {
        self.op_regions(name, operands, &[], attrs, &[result])[0]
    }

    /// Emits a generic op with any number of results and already printed regions.
    pub fn op_regions(
        &mut self,
        name: &str,
        operands: &[Value],
        regions: &[String],
        attrs: &str,
        results: &[TensorType],
    ) -> Vec<Value> {
        let outs: Vec<Value> = results.iter().map(|t| self.fresh(t.clone())).collect();
        let mut s = String::new();
        if !outs.is_empty() {
            let names: Vec<String> = outs.iter().map(|v| Self::name(*v)).collect();
            let _ = write!(s, "{} = ", names.join(", "));
        }
        let args: Vec<String> = operands.iter().map(|v| Self::name(*v)).collect();
        let _ = write!(s, "\"{}\"({})", name, args.join(", "));
        if !regions.is_empty() {
            let _ = write!(s, " ({})", regions.join(", "));
        }
        if !attrs.is_empty() {
            let _ = write!(s, " {{{attrs}}}");
        }
        let res: Vec<String> = results.iter().map(|t| t.mlir()).collect();
        let res = if res.len() == 1 {
            res[0].clone()
        } else {
            format!("({})", res.join(", "))
        };
        let _ = write!(s, " : {} -> {}", self.sig(operands), res);
        self.line(&s);
        outs
    }

    /// Builds a region with one block whose arguments have the given types; `f` emits the
    /// body and returns the values to yield with `stablehlo.return`.
    pub fn region(
        &mut self,
        arg_types: &[TensorType],
        f: impl FnOnce(&mut Builder, &[Value]) -> Vec<Value>,
    ) -> String {
        let args: Vec<Value> = arg_types.iter().map(|t| self.fresh(t.clone())).collect();
        self.bodies.push(String::new());
        let rets = f(self, &args);
        let sig = self.sig(&rets);
        let names: Vec<String> = rets.iter().map(|v| Self::name(*v)).collect();
        self.line(&format!(
            "\"stablehlo.return\"({}) : {} -> ()",
            names.join(", "),
            sig
        ));
        let body = self.bodies.pop().expect("region body");
        let header: Vec<String> = args
            .iter()
            .map(|v| format!("{}: {}", Self::name(*v), self.ty(*v).mlir()))
            .collect();
        format!("{{\n  ^bb0({}):\n{}  }}", header.join(", "), body)
    }

    /// Emits a call of a function printed by `func_text` (one of `extra` at `finish_with`).
    pub fn call(&mut self, callee: &str, operands: &[Value], results: &[TensorType]) -> Vec<Value> {
        let sig = Self::call_signature(
            &operands
                .iter()
                .map(|v| self.ty(*v).clone())
                .collect::<Vec<_>>(),
            results,
        );
        self.call_with_signature(callee, operands, results, &sig)
    }

    /// The `(operand types) -> (result types)` text of a call, to print once per callee.
    pub fn call_signature(operands: &[TensorType], results: &[TensorType]) -> String {
        let ins: Vec<String> = operands.iter().map(|t| t.mlir()).collect();
        let outs: Vec<String> = results.iter().map(|t| t.mlir()).collect();
        format!("({}) -> ({})", ins.join(", "), outs.join(", "))
    }

    /// `call` with a signature from `call_signature` (operands must have those types).
    pub fn call_with_signature(
        &mut self,
        callee: &str,
        operands: &[Value],
        results: &[TensorType],
        sig: &str,
    ) -> Vec<Value> {
        let outs: Vec<Value> = results.iter().map(|t| self.fresh(t.clone())).collect();
        let body = self.bodies.last_mut().expect("builder has a body");
        body.push_str("    ");
        for (i, v) in outs.iter().enumerate() {
            let _ = write!(body, "{}%v{}", if i > 0 { ", " } else { "" }, v.0);
        }
        if !outs.is_empty() {
            body.push_str(" = ");
        }
        body.push_str("\"func.call\"(");
        for (i, v) in operands.iter().enumerate() {
            let _ = write!(body, "{}%v{}", if i > 0 { ", " } else { "" }, v.0);
        }
        let _ = writeln!(body, ") {{callee = @{callee}}} : {sig}");
        outs
    }

    /// Bytes of `@main`'s body emitted so far (an op's text is the range between two reads).
    pub fn body_len(&self) -> usize {
        self.bodies[0].len()
    }

    /// `@main`'s body text so far.
    pub fn body(&self) -> &str {
        &self.bodies[0]
    }

    /// Values created so far (the next value's id).
    pub fn num_values(&self) -> u32 {
        self.types.len() as u32
    }

    /// The parameters, in order.
    pub fn params(&self) -> &[Value] {
        &self.params
    }

    fn func(&self, header: &str, outputs: &[Value]) -> String {
        self.print_func(
            header,
            &self.params,
            &self.bodies[0],
            &self.aliases,
            outputs,
        )
    }

    /// Prints `@main` made of part of this function: `params` (any values of the builder,
    /// op results included: they become parameters), `body` (lines of the body, in order),
    /// `aliases` (parameter, output index) and `outputs`; then the functions `extra`.
    pub fn finish_part(
        &self,
        params: &[Value],
        body: &str,
        aliases: &[(Value, usize)],
        outputs: &[Value],
        extra: &[&str],
    ) -> String {
        let mut s = String::from("module @torch_pjrt {\n");
        s.push_str(&self.print_func("func.func public @main", params, body, aliases, outputs));
        for f in extra {
            s.push_str(f);
        }
        for (_, f) in &self.funcs {
            s.push_str(f);
        }
        s.push_str("}\n");
        s
    }

    fn print_func(
        &self,
        header: &str,
        params: &[Value],
        body: &str,
        aliases: &[(Value, usize)],
        outputs: &[Value],
    ) -> String {
        let params: Vec<String> = params
            .iter()
            .map(|v| {
                let mut p = format!("{}: {}", Self::name(*v), self.ty(*v).mlir());
                if let Some((_, o)) = aliases.iter().find(|(a, _)| a == v) {
                    let _ = write!(p, " {{tf.aliasing_output = {o} : i32}}");
                }
                p
            })
            .collect();
        let rets: Vec<String> = outputs.iter().map(|v| self.ty(*v).mlir()).collect();
        let names: Vec<String> = outputs.iter().map(|v| Self::name(*v)).collect();
        let mut s = String::with_capacity(body.len() + 256);
        let _ = writeln!(
            s,
            "  {header}({}) -> ({}) {{",
            params.join(", "),
            rets.join(", ")
        );
        s.push_str(body);
        let _ = writeln!(
            s,
            "    \"func.return\"({}) : ({}) -> ()\n  }}",
            names.join(", "),
            rets.join(", ")
        );
        s
    }

    /// Prints the function as `func.func private @name`, to be called from another module.
    /// Without aliases: only `@main`'s parameters can donate their buffers. The functions it
    /// calls (`funcs`) are not printed: the caller's builder adds them.
    pub fn func_text(&self, name: &str, outputs: &[Value]) -> String {
        self.print_func(
            &format!("func.func private @{name}"),
            &self.params,
            &self.bodies[0],
            &[],
            outputs,
        )
    }

    /// Prints the module with `outputs` returned from `@main`.
    pub fn finish(&self, outputs: &[Value]) -> String {
        self.finish_with(outputs, &[])
    }

    /// Prints the module with `@main` followed by the functions `extra` (from `func_text`).
    pub fn finish_with(&self, outputs: &[Value], extra: &[&str]) -> String {
        let mut s = String::from("module @torch_pjrt {\n");
        s.push_str(&self.func("func.func public @main", outputs));
        for f in extra {
            s.push_str(f);
        }
        for (_, f) in &self.funcs {
            s.push_str(f);
        }
        s.push_str("}\n");
        s
    }
}
