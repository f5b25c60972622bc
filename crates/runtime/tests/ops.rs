//! Runs ops through the real plugin with host inputs, no PyTorch involved.

use runtime::exec::Loc;
use runtime::{dispatch, Outcome, Param, RArg, Ret, Runtime, TensorRef, View};
use stablehlo::DType;

fn rt() -> &'static Runtime {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.venv/lib/python3.11/site-packages");
    runtime::init(&[root]).expect("plugin")
}

fn host(data: &mut [f32], sizes: &[i64], strides: &[i64]) -> RArg {
    RArg::Tensor(TensorRef {
        loc: Loc::Host(data.as_mut_ptr() as *mut u8),
        dtype: Some(DType::F32),
        view: View {
            sizes: sizes.to_vec(),
            strides: strides.to_vec(),
            offset: 0,
        },
        nbytes: (data.len() * 4) as i64,
        wrapped: false,
        device: 0,
    })
}

fn arg(name: &str, a: RArg) -> Param {
    Param {
        name: name.into(),
        arg: a,
        is_write: false,
        is_out: false,
    }
}

fn run(op: &str, params: &[Param]) -> Vec<f32> {
    let rt = rt();
    match dispatch(rt, op, "", params).expect("dispatch") {
        Outcome::Done(rets) => match &rets[0] {
            Ret::Tensor { handle, .. } => {
                // SAFETY: a fresh storage handed to us.
                let s = unsafe { runtime::Storage::from_handle(*handle) };
                let bytes = s.bytes(rt).unwrap();
                bytes
                    .chunks(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            }
            r => panic!("unexpected return {r:?}"),
        },
        o => panic!("unexpected outcome {o:?}"),
    }
}

#[test]
fn add_with_alpha() {
    let mut a = [1.0f32, 2.0, 3.0, 4.0];
    let mut b = [10.0f32, 20.0, 30.0, 40.0];
    let r = run(
        "aten::add",
        &[
            arg("self", host(&mut a, &[4], &[1])),
            arg("other", host(&mut b, &[4], &[1])),
            arg("alpha", RArg::Int(2)),
        ],
    );
    assert_eq!(r, vec![21.0, 42.0, 63.0, 84.0]);
}

#[test]
fn mm_of_transposed_view() {
    // a = [[1,2],[3,4]] read transposed through strides.
    let mut a = [1.0f32, 2.0, 3.0, 4.0];
    let mut b = [1.0f32, 0.0, 0.0, 1.0];
    let r = run(
        "aten::mm",
        &[
            arg("self", host(&mut a, &[2, 2], &[1, 2])),
            arg("mat2", host(&mut b, &[2, 2], &[2, 1])),
        ],
    );
    assert_eq!(r, vec![1.0, 3.0, 2.0, 4.0]);
}

#[test]
fn reductions_and_softmax() {
    let mut a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let r = run(
        "aten::sum",
        &[
            arg("self", host(&mut a, &[2, 3], &[3, 1])),
            arg("dim", RArg::List(vec![RArg::Int(1)])),
            arg("keepdim", RArg::Bool(false)),
        ],
    );
    assert_eq!(r, vec![6.0, 15.0]);
    let r = run(
        "aten::_softmax",
        &[
            arg("self", host(&mut a, &[2, 3], &[3, 1])),
            arg("dim", RArg::Int(1)),
            arg("half_to_float", RArg::Bool(false)),
        ],
    );
    let e: Vec<f32> = [1.0f32, 2.0, 3.0].iter().map(|x| x.exp()).collect();
    let s: f32 = e.iter().sum();
    assert!((r[0] - e[0] / s).abs() < 1e-6);
    let (_, i) = (
        "max",
        run(
            "aten::argmax",
            &[
                arg("self", host(&mut a, &[2, 3], &[3, 1])),
                arg("dim", RArg::Int(1)),
                arg("keepdim", RArg::Bool(false)),
            ],
        ),
    );
    let _ = i;
}

#[test]
fn shape_error_is_a_user_error() {
    let mut a = [1.0f32, 2.0, 3.0];
    let mut b = [1.0f32, 2.0];
    let e = dispatch(
        rt(),
        "aten::mul",
        "",
        &[
            arg("self", host(&mut a, &[3], &[1])),
            arg("other", host(&mut b, &[2], &[1])),
        ],
    )
    .unwrap_err();
    assert!(
        e.msg.contains("must match the size of tensor b"),
        "{}",
        e.msg
    );
}
