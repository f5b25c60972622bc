//! Unit tests of the torch.nn families' helpers and shape rules.

use super::convolution::*;
use super::losses::*;
use super::nn_common::*;
use super::padding::*;
use super::pooling::*;
use super::resampling::*;

use crate::{Arg, Args, Builder, Ctx, DType, ErrorKind, Out, TensorArg, TensorType};

fn t(b: &mut Builder, dtype: DType, shape: &[i64]) -> Arg {
    let value = b.param(TensorType::new(dtype, shape));
    Arg::Tensor(TensorArg {
        value,
        dtype,
        shape: shape.to_vec(),
        wrapped_number: false,
    })
}

fn ints(v: &[i64]) -> Arg {
    Arg::List(v.iter().map(|i| Arg::Int(*i)).collect())
}

fn shapes(b: &Builder, outs: &[Out]) -> Vec<Option<Vec<i64>>> {
    outs.iter()
        .map(|o| match o {
            Out::T(v) => Some(b.shape(*v)),
            _ => None,
        })
        .collect()
}

#[test]
fn pooling_output_sizes() {
    assert_eq!(pool_out(5, 3, 1, 2, 1, false).unwrap(), 3);
    assert_eq!(pool_out(6, 3, 0, 2, 1, false).unwrap(), 2);
    assert_eq!(pool_out(6, 3, 0, 2, 1, true).unwrap(), 3);
    // ceil_mode drops a last window that would start in the right padding.
    assert_eq!(pool_out(5, 2, 1, 2, 1, true).unwrap(), 3);
    assert!(pool_out(5, 3, 2, 1, 1, false).is_err());
    assert_eq!(adaptive_windows(5, 3), vec![(0, 2), (1, 4), (3, 5)]);
    assert_eq!(avg_counts(5, 3, 2, 1, 3, true), vec![3.0, 3.0, 3.0]);
    assert_eq!(avg_counts(5, 3, 2, 1, 3, false), vec![2.0, 3.0, 2.0]);
}

#[test]
fn interpolation_rows_sum_to_one() {
    let kinds = [
        Interp::Linear,
        Interp::Cubic,
        Interp::LinearAa,
        Interp::CubicAa,
    ];
    for ac in [false, true] {
        for kind in kinds {
            for (i, o) in [(5, 9), (9, 4)] {
                for row in interp_matrix(kind, i, o, ac, None, true, DType::F32) {
                    assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6);
                }
            }
        }
    }
    let m = interp_matrix(Interp::Nearest, 3, 7, false, None, false, DType::F32);
    let src: Vec<usize> = m
        .iter()
        .map(|r| r.iter().position(|v| *v == 1.0).unwrap())
        .collect();
    assert_eq!(src, vec![0, 0, 0, 1, 1, 2, 2]);
}

#[test]
fn window_helpers() {
    // Replication with crops: output j copies x[clamp(j - l, 0, n - 1)].
    assert_eq!(replicate_runs(4, -4, 5), (0, 4, 4, 5));
    assert_eq!(replicate_runs(5, 5, -4), (5, 0, 1, 0));
    assert_eq!(replicate_runs(5, 2, -1), (2, 0, 4, 0));
    assert_eq!(window_taps(2, 3, 2, 1), vec![0, 1, 2, 2, 3, 4]);
    let (k, idx, w) = sparse_rows(&[vec![0.0, 0.5, 0.5], vec![1.0, 0.0, 0.0]]);
    assert_eq!((k, idx, w), (2, vec![1, 2, 0, 0], vec![0.5, 0.5, 1.0, 0.0]));
    // bf16 keeps 8 significant bits, f16 11; ties go to even.
    assert_eq!(round_to(1.0 / 3.0, DType::BF16), 0.333984375);
    assert_eq!(round_to(1.0 + 2f64.powi(-11), DType::F16), 1.0);
    assert_eq!(
        round_to(1.0 + 3.0 * 2f64.powi(-11), DType::F16),
        1.0 + 2f64.powi(-9)
    );
}

#[test]
fn grouped_strided_conv_backward_shapes() {
    let mut b = Builder::new();
    let items = vec![
        ("grad_output", t(&mut b, DType::F32, &[2, 6, 5, 5])),
        ("input", t(&mut b, DType::F32, &[2, 4, 9, 9])),
        ("weight", t(&mut b, DType::F32, &[6, 2, 3, 3])),
        ("stride", ints(&[2, 2])),
        ("padding", ints(&[1, 1])),
        ("dilation", ints(&[2, 2])),
        ("transposed", Arg::Bool(false)),
        ("output_padding", ints(&[0, 0])),
        ("groups", Arg::Int(2)),
        (
            "output_mask",
            Arg::List(vec![Arg::Bool(true), Arg::Bool(true), Arg::Bool(false)]),
        ),
    ];
    let args = Args {
        items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
    };
    let mut c = Ctx::new(&mut b, "aten::convolution_backward", "", &args);
    let outs = convolution_backward(&mut c).unwrap();
    assert_eq!(
        shapes(&b, &outs),
        vec![Some(vec![2, 4, 9, 9]), Some(vec![6, 2, 3, 3]), None]
    );
    let text = b.finish(&[]);
    assert!(text.contains("batch_group_count = 2"), "{text}");
}

#[test]
fn nll_loss_reports_size_mismatch() {
    let mut b = Builder::new();
    let items = vec![
        ("self", t(&mut b, DType::F32, &[3, 5])),
        ("target", t(&mut b, DType::I64, &[2])),
        ("weight", Arg::None),
        ("reduction", Arg::Int(1)),
        ("ignore_index", Arg::Int(-100)),
    ];
    let args = Args {
        items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
    };
    let mut c = Ctx::new(&mut b, "aten::nll_loss_forward", "", &args);
    match nll_loss(&mut c, false) {
        Err(crate::LowerError::User(ErrorKind::Runtime, m)) => {
            assert_eq!(m, "size mismatch (got input: [3, 5], target: [2])")
        }
        _ => panic!("expected an error"),
    }
}
