//! "Did you mean": the known name nearest to a misspelled one, by edit distance.

/// Edits (insert, delete, substitute one character, or swap two adjacent ones) that
/// turn `a` into `b`: the optimal-string-alignment distance, case-sensitive.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // Three rows: the one before the previous (for swaps), the previous, this one.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut row = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        row[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (prev[j] + 1).min(row[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(before[j - 2] + 1);
            }
            row[j] = d;
        }
        std::mem::swap(&mut before, &mut prev);
        std::mem::swap(&mut prev, &mut row);
    }
    prev[b.len()]
}

/// The candidate nearest to `name` when it is near enough to be a typo of it: at most
/// 1 + len/4 edits away (ignoring case), the nearest first-listed on ties. `None` when
/// nothing is that near.
///
/// ```
/// use idem_core::descriptor::nearest;
/// let fields = ["maxAttempts", "initialBackoff"];
/// assert_eq!(nearest("maxAttempt", fields), Some("maxAttempts"));
/// assert_eq!(nearest("timeout", fields), None);
/// ```
pub fn nearest<'c>(name: &str, candidates: impl IntoIterator<Item = &'c str>) -> Option<&'c str> {
    let lower = name.to_lowercase();
    candidates
        .into_iter()
        .filter(|c| *c != name)
        .map(|c| (edit_distance(&lower, &c.to_lowercase()), c))
        .filter(|(d, c)| *d <= 1 + c.chars().count().max(lower.chars().count()) / 4)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("abc", ""), 3);
        assert_eq!(edit_distance("Charg", "Charge"), 1);
        assert_eq!(edit_distance("Chrage", "Charge"), 1);
        assert_eq!(edit_distance("idempotence", "idempotency"), 1);
        assert_eq!(edit_distance("retryPolicies", "retryPolicy"), 3);
        assert_eq!(
            edit_distance("payment.v1.Payments", "payments.v1.Payments"),
            1
        );
    }

    #[test]
    fn the_issues_typos_find_their_field() {
        let method = [
            "name",
            "timeout",
            "retryPolicy",
            "hedgingPolicy",
            "idempotency",
        ];
        assert_eq!(nearest("idempotence", method), Some("idempotency"));
        assert_eq!(nearest("retryPolicies", method), Some("retryPolicy"));
        assert_eq!(nearest("maxAttempt", ["maxAttempts"]), Some("maxAttempts"));
        assert_eq!(nearest("loadBalancingConfig", method), None);
        assert_eq!(nearest("x", method), None);
    }

    proptest::proptest! {
        #[test]
        fn distance_is_a_metric_bound(a in "\\PC{0,12}", b in "\\PC{0,12}") {
            let d = edit_distance(&a, &b);
            proptest::prop_assert_eq!(d, edit_distance(&b, &a));
            proptest::prop_assert!(d <= a.chars().count().max(b.chars().count()));
            proptest::prop_assert_eq!(edit_distance(&a, &a), 0);
        }
    }
}
