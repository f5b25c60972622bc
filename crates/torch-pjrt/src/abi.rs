//! Rust mirror of `shim/tpu_abi.h` and the conversions to runtime types.

use std::ffi::{c_char, c_void, CStr};

use runtime::exec::Loc;
use runtime::{DType, ErrorKind, Param, RArg, TensorRef, View};

pub const MAX_DIMS: usize = 16;

#[repr(C)]
pub struct TpuTensor {
    pub handle: *mut c_void,
    pub host_data: *mut c_void,
    pub is_cpu: i32,
    pub dtype: i32,
    pub device_index: i32,
    pub ndim: i32,
    pub sizes: *const i64,
    pub strides: *const i64,
    pub storage_offset: i64,
    pub storage_nbytes: i64,
    pub is_wrapped_number: i32,
    pub requires_grad: i32,
}

#[repr(C)]
pub struct TpuArg {
    pub name: *const c_char,
    pub kind: i32,
    pub scalar_kind: i32,
    pub is_write: i32,
    pub is_out: i32,
    pub i: i64,
    pub d: f64,
    pub d_imag: f64,
    pub s: *const c_char,
    pub t: TpuTensor,
    pub list_len: i64,
    pub list: *const TpuArg,
    pub gen_state: *mut i64,
}

#[repr(C)]
pub struct TpuRet {
    pub kind: i32,
    pub alias_arg: i32,
    pub handle: *mut c_void,
    pub dtype: i32,
    pub device_index: i32,
    pub ndim: i32,
    pub sizes: [i64; MAX_DIMS],
    pub i: i64,
    pub d: f64,
}

#[repr(C)]
pub struct TpuError {
    pub kind: i32,
    pub msg: [u8; 2048],
    pub n_resize: i32,
    pub resize_arg: [i32; 8],
    pub resize_ndim: [i32; 8],
    pub resize_sizes: [[i64; MAX_DIMS]; 8],
    pub resize_column_major: [i32; 8],
}

// Arg kinds.
const NONE: i32 = 0;
const TENSOR: i32 = 1;
const INT: i32 = 2;
const DOUBLE: i32 = 3;
const BOOL: i32 = 4;
const STRING: i32 = 5;
const LIST: i32 = 6;
const SCALAR_TYPE: i32 = 7;
const GENERATOR: i32 = 8;
const COMPLEX: i32 = 9;
const DEVICE: i32 = 10;
const LAYOUT: i32 = 11;
/// c10::Layout::Strided, the only layout the device has.
const STRIDED: i64 = 0;

// Scalar kinds.
const SCALAR_INT: i32 = 1;
const SCALAR_DOUBLE: i32 = 2;
const SCALAR_BOOL: i32 = 3;

// Ret kinds.
pub const RET_TENSOR: i32 = 0;
pub const RET_ALIAS: i32 = 1;
pub const RET_INT: i32 = 2;
pub const RET_DOUBLE: i32 = 3;
pub const RET_BOOL: i32 = 4;
pub const RET_NONE: i32 = 5;
pub const RET_LIST: i32 = 6;
pub const RET_ALIAS_LIST_ELEM: i32 = 7;

/// c10::ScalarType -> DType (None: not supported on the device).
pub fn dtype_from_c10(v: i32) -> Option<DType> {
    Some(match v {
        0 => DType::U8,
        1 => DType::I8,
        2 => DType::I16,
        3 => DType::I32,
        4 => DType::I64,
        5 => DType::F16,
        6 => DType::F32,
        7 => DType::F64,
        9 => DType::C64,
        10 => DType::C128,
        11 => DType::Bool,
        15 => DType::BF16,
        _ => return None,
    })
}

pub fn dtype_to_c10(d: DType) -> i32 {
    match d {
        DType::U8 => 0,
        DType::I8 => 1,
        DType::I16 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
        DType::F16 => 5,
        DType::F32 => 6,
        DType::F64 => 7,
        DType::C64 => 9,
        DType::C128 => 10,
        DType::Bool => 11,
        DType::BF16 => 15,
        DType::U32 => 28,
        DType::U64 => 29,
    }
}

pub fn err_kind_code(k: ErrorKind) -> i32 {
    match k {
        ErrorKind::Runtime => 0,
        ErrorKind::Value => 1,
        ErrorKind::Type => 2,
        ErrorKind::Index => 3,
        ErrorKind::NotImplemented => 4,
        ErrorKind::OutOfMemory => 5,
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string alive for the call.
pub unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated per the ABI.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// # Safety
/// `t` must be a descriptor filled by the shim, with `ndim` sizes and strides.
pub unsafe fn tensor(t: &TpuTensor) -> TensorRef {
    let n = t.ndim.max(0) as usize;
    // SAFETY: the shim passes `ndim` sizes and strides that stay alive during the call.
    let (sizes, strides) = unsafe {
        if n == 0 {
            (vec![], vec![])
        } else {
            (
                std::slice::from_raw_parts(t.sizes, n).to_vec(),
                std::slice::from_raw_parts(t.strides, n).to_vec(),
            )
        }
    };
    let loc = if t.is_cpu != 0 {
        Loc::Host(t.host_data as *mut u8)
    } else {
        Loc::Device(t.handle as *const runtime::Storage)
    };
    TensorRef {
        loc,
        dtype: dtype_from_c10(t.dtype),
        view: View {
            sizes,
            strides,
            offset: t.storage_offset,
        },
        nbytes: t.storage_nbytes,
        wrapped: t.is_wrapped_number != 0,
        device: t.device_index.max(0) as usize,
    }
}

/// # Safety
/// `a` must be an argument filled by the shim (lists point at `list_len` elements).
pub unsafe fn arg(a: &TpuArg) -> RArg {
    match a.kind {
        NONE => RArg::None,
        // SAFETY: per the ABI, the descriptor is filled for tensor arguments.
        TENSOR => RArg::Tensor(unsafe { tensor(&a.t) }),
        INT | DOUBLE | BOOL if a.scalar_kind != 0 => match a.scalar_kind {
            SCALAR_INT => RArg::Int(a.i),
            SCALAR_DOUBLE => RArg::Float(a.d),
            SCALAR_BOOL => RArg::Bool(a.i != 0),
            _ => RArg::Other("scalar".into()),
        },
        INT => RArg::Int(a.i),
        DOUBLE => RArg::Float(a.d),
        COMPLEX => RArg::Complex(a.d, a.d_imag),
        BOOL => RArg::Bool(a.i != 0),
        // SAFETY: strings are NUL-terminated and alive for the call.
        STRING => RArg::Str(unsafe { cstr(a.s) }),
        SCALAR_TYPE => RArg::ScalarType(dtype_from_c10(a.i as i32)),
        GENERATOR => RArg::Generator(a.gen_state),
        DEVICE => RArg::Device(a.i.max(0) as usize),
        // Strided is every tensor's layout here: nothing to tell the rule.
        LAYOUT if a.i == STRIDED => RArg::None,
        LIST => {
            let n = a.list_len.max(0) as usize;
            let items = if n == 0 || a.list.is_null() {
                &[][..]
            } else {
                // SAFETY: `list` points at `list_len` elements alive for the call.
                unsafe { std::slice::from_raw_parts(a.list, n) }
            };
            // SAFETY: elements follow the same contract.
            RArg::List(items.iter().map(|x| unsafe { arg(x) }).collect())
        }
        k => RArg::Other(format!("kind {k}")),
    }
}

/// # Safety
/// `args` points at `n` shim-filled arguments.
pub unsafe fn params(args: *const TpuArg, n: i32) -> Vec<Param> {
    if n <= 0 || args.is_null() {
        return vec![];
    }
    // SAFETY: the shim passes `n` arguments alive for the call.
    let items = unsafe { std::slice::from_raw_parts(args, n as usize) };
    items
        .iter()
        .map(|a| Param {
            // SAFETY: as above.
            name: unsafe { cstr(a.name) },
            // SAFETY: as above.
            arg: unsafe { arg(a) },
            is_write: a.is_write != 0,
            is_out: a.is_out != 0,
        })
        .collect()
}

impl TpuError {
    pub fn set(&mut self, kind: ErrorKind, msg: &str) {
        self.kind = err_kind_code(kind);
        let b = msg.as_bytes();
        let n = b.len().min(self.msg.len() - 1);
        self.msg[..n].copy_from_slice(&b[..n]);
        self.msg[n] = 0;
    }
}

impl TpuRet {
    pub fn zeroed() -> TpuRet {
        TpuRet {
            kind: RET_NONE,
            alias_arg: -1,
            handle: std::ptr::null_mut(),
            dtype: 0,
            device_index: 0,
            ndim: 0,
            sizes: [0; MAX_DIMS],
            i: 0,
            d: 0.0,
        }
    }
}
