// The figure check (benchmarks/figure_check.py), loaded into a page as a script. It defines
//   k3labCheckFigure(gd): the problems of a drawn plotly figure (strings), every dropdown button walked;
//   k3labDrawAndCheck(spec): draws a figure spec in #fig (WIDTH_PX wide) and checks it.
window.k3labCheckFigure = async (gd) => {
  const menus = (gd._fullLayout.updatemenus || []);
  const check = (label) => {
    const spec = {layout: gd.layout || {}};
    const out = [];
    const full = gd._fullLayout;
    const svg = gd.querySelector('svg.main-svg').getBoundingClientRect();
    const rect = el => el.getBoundingClientRect();
    const visible = el => {
      for (let e = el; e && e !== gd; e = e.parentElement) {
        const s = getComputedStyle(e);
        if (s.display === 'none' || s.visibility === 'hidden' || s.opacity === '0') return false;
      }
      const r = rect(el);
      return r.width > 0.5 && r.height > 0.5;
    };
    // ---------------------------------------------------------------- text boxes
    const texts = [];
    const add = (el, kind, group, name) => { if (visible(el)) texts.push({el, kind, group, name, r: rect(el)}); };
    gd.querySelectorAll('.g-gtitle text').forEach(el => add(el, 'title', 'title', el.textContent));
    gd.querySelectorAll('g.annotation').forEach(g => {
      const t = g.querySelector('text.annotation-text') || g.querySelector('text');
      if (t) add(t, 'annotation', 'ann' + g.getAttribute('data-index'), t.textContent);
    });
    gd.querySelectorAll('.infolayer text').forEach(el => {
      const c = el.getAttribute('class') || '';
      const m = /^([xy]\d*)title$/.exec(c);
      if (m) add(el, 'axis title', 'axtitle' + m[1], el.textContent);
    });
    gd.querySelectorAll('g[class$="tick"] > text, g[class$="tick2"] > text').forEach(el => {
      if (el.closest('.colorbar')) return;  // colour bar ticks: below, each one its own box
      const c = el.parentElement.getAttribute('class') || '';
      add(el, 'tick', 'tick' + c, el.textContent);
    });
    gd.querySelectorAll('.legend text.legendtext').forEach(el => add(el, 'legend', 'legend' + texts.length, el.textContent));
    gd.querySelectorAll('.legend text.legendtitletext').forEach(el => add(el, 'legend title', 'legendtitle', el.textContent));
    gd.querySelectorAll('.colorbar').forEach((cb, k) => {
      cb.querySelectorAll('.cbtitle text').forEach(el => add(el, 'colour bar title', 'cb' + k + 'title', el.textContent));
      cb.querySelectorAll('text').forEach(el => {
        if (el.closest('.cbtitle')) return;
        add(el, 'colour bar tick', 'cb' + k + 'tick' + texts.length, el.textContent);
      });
    });
    gd.querySelectorAll('.updatemenu-container text').forEach(el => add(el, 'dropdown', 'menu', el.textContent));
    const overlap = (a, b, tol) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > tol &&
                                   Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > tol;
    for (let i = 0; i < texts.length; i++) {
      for (let j = i + 1; j < texts.length; j++) {
        const a = texts[i], b = texts[j];
        if (a.group === b.group) continue;
        if (a.el.contains(b.el) || b.el.contains(a.el)) continue;
        if (overlap(a.r, b.r, 1.5)) out.push(`text overlap: ${a.kind} '${a.name.slice(0, 40)}' and ${b.kind} '${b.name.slice(0, 40)}'`);
      }
    }
    for (const t of texts) {
      if (t.r.left < svg.left - 1 || t.r.right > svg.right + 1 || t.r.top < svg.top - 1 || t.r.bottom > svg.bottom + 1)
        out.push(`text cut by the figure edge: ${t.kind} '${t.name.slice(0, 40)}'`);
    }
    // ---------------------------------------------------------------- legend
    const legend = gd.querySelector('.legend');
    if (legend && visible(legend)) {
      const bg = legend.querySelector('rect.bg');
      const box = legend.querySelector('.scrollbox');
      if (bg && box) {
        const b = rect(bg), c = box.getBBox();
        if (c.height > b.height + 2) out.push(`legend scrolls: ${Math.round(c.height)} px of entries in ${Math.round(b.height)} px`);
        if (b.right > svg.right + 1 || b.bottom > svg.bottom + 1 || b.left < svg.left - 1 || b.top < svg.top - 1)
          out.push('legend cut by the figure edge');
      }
    }
    // ---------------------------------------------------------------- data inside axes, marks for the note check
    const axisOf = id => full[id.replace(/^([xy])/, '$1axis')];
    const marks = [];  // page-pixel rectangles of drawn data
    (gd.calcdata || []).forEach((cd, i) => {
      const tr = gd._fullData[i];
      if (!tr || tr.visible !== true || !tr.xaxis) return;
      const xa = axisOf(tr.xaxis), ya = axisOf(tr.yaxis);
      if (!xa || !ya) return;
      const ox = svg.left + xa._offset, oy = svg.top + ya._offset;
      const bad = (px, len) => !(px >= -1.5 && px <= len + 1.5);
      const name = tr.name || `trace ${i}`;
      let outside = 0;
      if (tr.type === 'scatter' && tr.mode !== 'none') {
        for (const d of cd) {
          const px = xa.c2p(d.x), py = ya.c2p(d.y);
          if (!isFinite(px) || !isFinite(py)) continue;
          if (bad(px, xa._length) || bad(py, ya._length)) outside++;
          marks.push({left: ox + px - 2, right: ox + px + 2, top: oy + py - 2, bottom: oy + py + 2});
        }
      } else if (tr.type === 'bar') {
        const h = tr.orientation === 'h';
        const pa = h ? ya : xa, va = h ? xa : ya;
        for (const d of cd) {
          const s0 = d.s0 !== undefined ? d.s0 : d.b, s1 = d.s1 !== undefined ? d.s1 : d.b + d.s;
          if (!isFinite(s0) || !isFinite(s1) || !isFinite(d.p)) continue;
          const v0 = va.c2p(s0), v1 = va.c2p(s1), p = pa.c2p(d.p);
          if ((va.type === 'log' ? false : bad(v0, va._length)) || bad(v1, va._length) || bad(p, pa._length)) outside++;
          const lo = Math.min(v0, v1), hi = Math.max(v0, v1);
          if (h) marks.push({left: ox + lo, right: ox + hi, top: oy + p - 3, bottom: oy + p + 3});
          else marks.push({left: ox + p - 3, right: ox + p + 3, top: oy + lo, bottom: oy + hi});
        }
      } else if (tr.type === 'heatmap') {
        marks.push({left: ox, right: ox + xa._length, top: oy, bottom: oy + ya._length, heatmap: true});
      }
      const area = {left: ox, right: ox + xa._length, top: oy, bottom: oy + ya._length};
      for (let k = marks.length - 1; k >= 0 && !marks[k].clipped; k--) {
        const m = marks[k];
        m.clipped = true;
        m.left = Math.max(m.left, area.left); m.right = Math.min(m.right, area.right);
        m.top = Math.max(m.top, area.top); m.bottom = Math.min(m.bottom, area.bottom);
      }
      if (outside) out.push(`${outside} point(s) of '${name}' outside the axis range (${tr.xaxis}/${tr.yaxis})`);
    });
    // ---------------------------------------------------------------- panels: data or a note; notes not over data
    const anns = Array.from(gd.querySelectorAll('g.annotation')).filter(visible).map(g => ({
      r: rect(g.querySelector('text') || g), text: (g.textContent || '').slice(0, 50)}));
    for (const key of Object.keys(full._plots || {})) {
      const p = full._plots[key];
      const xa = p.xaxis, ya = p.yaxis;
      if (ya.overlaying || xa.overlaying) continue;
      const area = {left: svg.left + xa._offset, right: svg.left + xa._offset + xa._length,
                    top: svg.top + ya._offset, bottom: svg.top + ya._offset + ya._length};
      const drawn = (tr, d) => d && (tr.type === 'bar' ? isFinite(d.s) && d.s !== 0
                                    : isFinite(d.y) || isFinite(d.x) || d.z || isFinite(d.med));
      const has = gd._fullData.some((tr, i) => tr.visible === true && tr.xaxis === xa._id && tr.yaxis === ya._id &&
                                             (gd.calcdata[i] || []).some(d => drawn(tr, d)));
      const inside = anns.filter(a => (a.r.left + a.r.right) / 2 > area.left && (a.r.left + a.r.right) / 2 < area.right &&
                                      (a.r.top + a.r.bottom) / 2 > area.top && (a.r.top + a.r.bottom) / 2 < area.bottom);
      if (!has && !inside.length) out.push(`empty panel ${key} without a note`);
    }
    for (const a of anns) {
      const hit = marks.find(m => overlap(a.r, m, 1));
      if (hit) out.push(`note '${a.text}' over data`);
    }
    for (const t of texts.filter(t => t.kind === 'axis title')) {  // a y title squeezed onto the next panel
      if (marks.find(m => overlap(t.r, m, 2))) out.push(`axis title '${t.name.slice(0, 40)}' over data`);
    }
    // ---------------------------------------------------------------- colours: one meaning per colour
    const colourOf = tr => {
      const c = (tr.marker && typeof tr.marker.color === 'string' && tr.type !== 'scatter') ? tr.marker.color
              : (tr.mode && tr.mode.includes('lines') && tr.line) ? tr.line.color
              : (tr.marker && typeof tr.marker.color === 'string') ? tr.marker.color : null;
      return c ? c.replace(/\s/g, '').toLowerCase() : null;
    };
    const xs = Object.keys(full).filter(k => /^xaxis\d*$/.test(k)).map(k => full[k]);
    const twoPanels = xs.some(a => a.domain[1] <= 0.5) && xs.some(a => a.domain[0] >= 0.5) && (spec.layout.meta || {}).export_width;
    const side = tr => (full[tr.xaxis.replace('x', 'xaxis')].domain[0] >= 0.5 ? 'B' : 'A');
    const byName = {};
    for (const tr of gd._fullData) {
      if (tr.visible === false || !tr.name || !tr.xaxis || tr.type === 'heatmap') continue;
      const c = colourOf(tr);
      if (!c) continue;
      const key = tr.name;
      (byName[key] = byName[key] || []).push({c, side: twoPanels ? side(tr) : 'A', legend: tr.showlegend});
    }
    for (const [name, list] of Object.entries(byName)) {
      const colours = new Set(list.map(e => e.c));
      if (colours.size > 1) out.push(`series '${name}' drawn in ${colours.size} colours (${[...colours].join(', ')})`);
    }
    const legendColours = new Set();
    const legendNames = new Set();
    gd._fullData.forEach(tr => { if (tr.showlegend && tr.visible !== false) { legendNames.add(tr.name); const c = colourOf(tr); if (c) legendColours.add(c); } });
    if (legendNames.size && full.showlegend !== false) {
      for (const tr of gd._fullData) {
        if (tr.visible !== true || tr.showlegend || tr.type !== 'scatter' || !tr.name) continue;
        const c = colourOf(tr);
        if (c && !legendColours.has(c) && !legendNames.has(tr.name)) out.push(`series '${tr.name}' (${c}) has no legend entry`);
      }
    }
    // ---------------------------------------------------------------- colour bars
    gd.querySelectorAll('.colorbar').forEach((cb, k) => {
      const ticks = Array.from(cb.querySelectorAll('text')).filter(el => !el.closest('.cbtitle') && visible(el) && el.textContent.trim());
      if (ticks.length < 4) out.push(`colour bar ${k} has ${ticks.length} labelled ticks`);
    });
    return out.map(p => label ? `[${label}] ${p}` : p);
  };
  let problems = check('');
  if (typeof Plotly === 'undefined') return problems;  // in the app: plotly.js is not a global, menus not walked
  for (const [m, menu] of menus.entries()) {
    for (const [b, button] of (menu.buttons || []).entries()) {
      if (b === (menu.active || 0) || button.method === 'skip') continue;
      await Plotly.relayout(gd, {[`updatemenus[${m}].active`]: b});
      if (button.method === 'update') await Plotly.update(gd, button.args[0] || {}, button.args[1] || {});
      else if (button.method === 'restyle') await Plotly.restyle(gd, button.args[0] || {});
      else if (button.method === 'relayout') await Plotly.relayout(gd, button.args[0] || {});
      problems = problems.concat(check(button.label || `button ${b}`));
    }
    const first = (menu.buttons || [])[menu.active || 0];
    if (first && first.method === 'update' && (menu.buttons || []).length > 1) {
      await Plotly.relayout(gd, {[`updatemenus[${m}].active`]: menu.active || 0});
      await Plotly.update(gd, first.args[0] || {}, first.args[1] || {});
    }
  }
  return problems;
};

window.k3labDrawAndCheck = async (spec) => {
  const gd = document.getElementById('fig');
  Plotly.purge(gd);
  gd.innerHTML = '';
  const layout = Object.assign({}, spec.layout || {});
  layout.width = layout.width || WIDTH_PX;
  await Plotly.newPlot(gd, spec.data || [], layout, {displayModeBar: false});
  return await window.k3labCheckFigure(gd);
};
