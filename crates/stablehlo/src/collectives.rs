//! Cross-replica collectives: one program runs once per replica (`pjrt`'s
//! `compile_replicated`), and these ops exchange values between the replicas of each group.
//! A group is a list of replica ids; every group of one op has the same size, and a
//! replica's position in its group orders the gathered, scattered and exchanged pieces.

use crate::{Builder, ReduceKind, TensorType, Value};

/// `dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>`.
fn groups_attr(groups: &[Vec<i64>]) -> String {
    let n = groups.first().map_or(0, Vec::len);
    assert!(
        groups.iter().all(|g| g.len() == n),
        "replica groups of one op have one size"
    );
    let rows: Vec<String> = groups
        .iter()
        .map(|g| {
            let ids: Vec<String> = g.iter().map(i64::to_string).collect();
            format!("[{}]", ids.join(", "))
        })
        .collect();
    format!(
        "dense<[{}]> : tensor<{}x{}xi64>",
        rows.join(", "),
        groups.len(),
        n
    )
}

impl Builder {
    /// The plain combiner (XLA's collectives take one op, not `combine`'s NaN selects: max
    /// and min then follow the hardware, as Gloo's and NCCL's do).
    fn combiner(&mut self, x: Value, kind: ReduceKind) -> String {
        let dtype = self.dtype(x);
        let scalar = TensorType::scalar(dtype);
        self.region(&[scalar.clone(), scalar], |b, a| {
            vec![b.binary(kind.op_name(dtype), a[0], a[1])]
        })
    }

    /// `kind` of `x` over the replicas of each group, on every one of them.
    pub fn all_reduce(&mut self, x: Value, groups: &[Vec<i64>], kind: ReduceKind) -> Value {
        let region = self.combiner(x, kind);
        let attrs = format!("replica_groups = {}", groups_attr(groups));
        let ty = self.ty(x).clone();
        self.op_regions("stablehlo.all_reduce", &[x], &[region], &attrs, &[ty])[0]
    }

    /// The group's `x`s concatenated along `dim`, in group order.
    pub fn all_gather(&mut self, x: Value, dim: usize, groups: &[Vec<i64>]) -> Value {
        let n = groups.first().map_or(1, Vec::len) as i64;
        let mut ty = self.ty(x).clone();
        ty.shape[dim] *= n;
        let attrs = format!(
            "all_gather_dim = {dim} : i64, replica_groups = {}",
            groups_attr(groups)
        );
        self.op("stablehlo.all_gather", &[x], &attrs, ty)
    }

    /// `kind` over the group, split along `dim`: replica `i` of a group keeps piece `i`.
    pub fn reduce_scatter(
        &mut self,
        x: Value,
        dim: usize,
        groups: &[Vec<i64>],
        kind: ReduceKind,
    ) -> Value {
        let n = groups.first().map_or(1, Vec::len) as i64;
        let mut ty = self.ty(x).clone();
        assert!(ty.shape[dim] % n == 0, "reduce_scatter splits evenly");
        ty.shape[dim] /= n;
        let region = self.combiner(x, kind);
        let attrs = format!(
            "scatter_dimension = {dim} : i64, replica_groups = {}",
            groups_attr(groups)
        );
        self.op_regions("stablehlo.reduce_scatter", &[x], &[region], &attrs, &[ty])[0]
    }

    /// `x` split in group-size pieces along `split`; piece `j` goes to the group's replica
    /// `j`, and the pieces received are concatenated along `concat` in sender order.
    pub fn all_to_all(
        &mut self,
        x: Value,
        split: usize,
        concat: usize,
        groups: &[Vec<i64>],
    ) -> Value {
        let n = groups.first().map_or(1, Vec::len) as i64;
        let mut ty = self.ty(x).clone();
        assert!(ty.shape[split] % n == 0, "all_to_all splits evenly");
        ty.shape[split] /= n;
        ty.shape[concat] *= n;
        let attrs = format!(
            "split_dimension = {split} : i64, concat_dimension = {concat} : i64, split_count = {n} : i64, replica_groups = {}",
            groups_attr(groups)
        );
        self.op("stablehlo.all_to_all", &[x], &attrs, ty)
    }

    /// Each `(source, target)` pair sends the source's `x` to the target; a replica no pair
    /// targets gets zeros.
    pub fn collective_permute(&mut self, x: Value, pairs: &[(i64, i64)]) -> Value {
        let rows: Vec<Vec<i64>> = pairs.iter().map(|(s, t)| vec![*s, *t]).collect();
        let attrs = if rows.is_empty() {
            "source_target_pairs = dense<> : tensor<0x2xi64>".to_string()
        } else {
            format!("source_target_pairs = {}", groups_attr(&rows))
        };
        let ty = self.ty(x).clone();
        self.op("stablehlo.collective_permute", &[x], &attrs, ty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn collectives_print_their_groups() {
        let mut b = Builder::new();
        let x = b.param(TensorType::new(DType::F32, &[4, 2]));
        let groups = vec![vec![0, 1], vec![2, 3]];
        let s = b.all_reduce(x, &groups, ReduceKind::Sum);
        let g = b.all_gather(x, 0, &groups);
        let r = b.reduce_scatter(x, 0, &groups, ReduceKind::Max);
        let a = b.all_to_all(x, 0, 1, &groups);
        let p = b.collective_permute(x, &[(0, 1), (1, 0)]);
        assert_eq!(b.shape(g), vec![8, 2]);
        assert_eq!(b.shape(r), vec![2, 2]);
        assert_eq!(b.shape(a), vec![2, 4]);
        let text = b.finish(&[s, g, r, a, p]);
        assert!(text.contains("replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>"));
        assert!(text.contains("source_target_pairs = dense<[[0, 1], [1, 0]]> : tensor<2x2xi64>"));
    }
}
